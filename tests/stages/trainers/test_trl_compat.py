"""Our trainers and configs against TRL 1.16 itself: every TRL name is ours or listed as unsupported.

For each TRL trainer `__init__` and config dataclass (SFT, Reward, DPO, KTO, online DPO, GRPO;
TRL 1.16 has no PPO), every parameter or field name TRL has must exist on our side with a
loosely compatible type (bool / int / float / str / list / dict / other), or be listed in
`stages.trainers.trl_compat.UNSUPPORTED` with a reason. An entry there that no longer names a
gap fails too. Positional parameters sit where TRL has them. The coverage per class is printed
(`pytest -s` or the terminal: `DPOConfig: 120/139 TRL fields ...`).

The TRL tests are skipped when trl is not installed (`pip install -e .[bench]`);
`unsupported_trl_fields` is tested without it.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing

import pytest

from stages.methods import METHODS as REGISTRY
from stages.trainers import trl_compat
from stages.trainers.trl_compat import UNSUPPORTED, inherited_from_transformers, unsupported_trl_fields

# (our classes' prefix, e.g. "OnlineDPO", its record) of every method with a TRL counterpart (stages.methods)
METHODS = [(m.trainer.rpartition(":")[2].removesuffix("Trainer"), m) for m in REGISTRY.values() if m.trl]

# Names the lead's config change (issue 32, item 1) adds under TRL's names: allowed missing until then,
# and an error once present (delete the entry at merge).
PENDING: dict[str, set[str]] = {}  # TRL names a change in flight is adding (none now)


# ------------------------------------------------------------------------------ loose types

_NAMES = {"bool": "bool", "int": "int", "float": "float", "str": "str", "None": "None", "NoneType": "None",
          "list": "list", "tuple": "list", "set": "list", "Sequence": "list", "dict": "dict", "Mapping": "dict",
          "Any": "any", "Literal": "literal"}
_TYPES = {bool: "bool", int: "int", float: "float", str: "str", type(None): "None", list: "list", tuple: "list",
          set: "list", dict: "dict"}


def kinds(annotation) -> set[str]:
    """An annotation as a set of loose kinds: bool, int, float, str, list, dict, None, object, any."""
    if annotation in (inspect.Parameter.empty, typing.Any):
        return {"any"}
    if isinstance(annotation, str):
        return _string_kinds(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return set().union(*(kinds(a) for a in typing.get_args(annotation)))
    if origin is typing.Literal:
        return {_TYPES.get(type(v), "object") for v in typing.get_args(annotation)}
    if origin is not None:
        return {_TYPES.get(origin, "list" if origin.__name__ in ("Sequence", "Iterable") else
                           "dict" if origin.__name__ in ("Mapping",) else "object")}
    return {_TYPES.get(annotation, "object")}


def _string_kinds(text: str) -> set[str]:
    """'int | None', 'list[str]', 'Literal["a", "b"]', 'PreTrainedModel | None' -> kinds, without evaluating."""
    out = set()
    for part in _top_level_split(text):
        head = part.split("[", 1)[0].strip().rsplit(".", 1)[-1]
        if head == "Literal":
            out |= {"str" if v.strip()[:1] in "'\"" else "bool" if v.strip() in ("True", "False") else
                    "float" if "." in v else "int" for v in part.split("[", 1)[1].rstrip("]").split(",")}
        elif head in ("Optional", "Union"):
            out |= _string_kinds(part.split("[", 1)[1].rsplit("]", 1)[0].replace(",", "|")) | (
                {"None"} if head == "Optional" else set())
        else:
            out.add(_NAMES.get(head, "object"))
    return out


def _top_level_split(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "|" and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [p.strip() for p in parts + [current] if p.strip()]


def compatible(theirs: set[str], ours: set[str]) -> bool:
    """Loose: either side untyped or an object type, or the kinds other than None overlap (an int fits a float)."""
    if {"any", "object"} & (theirs | ours):
        return True
    theirs, ours = theirs - {"None"} or {"None"}, ours - {"None"} or {"None"}
    if "float" in ours:
        ours = ours | {"int"}
    return bool(theirs & ours)


# ------------------------------------------------------------------------------ what each side has

def dataclass_types(cls) -> dict[str, set[str]]:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 -- a name only importable under TYPE_CHECKING: read the strings
        hints = {}
    return {f.name: kinds(hints.get(f.name, f.type)) for f in dataclasses.fields(cls)}


def signature_types(fn) -> dict[str, tuple[set[str], int | None]]:
    """Parameter -> (kinds, position among the positional-or-keyword parameters, else None); self dropped."""
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"
              and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    return {p.name: (kinds(p.annotation), positional.index(p.name) if p.name in positional else None)
            for p in params}


@pytest.fixture(scope="module")
def pairs():
    """[(kind "Config"/"Trainer", name, TRL's names -> kinds, ours -> kinds, ours: class or function)]."""
    trl = pytest.importorskip("trl", reason="trl is not installed (pip install -e .[bench]): nothing to compare with")
    if not trl.__version__.startswith(f"{trl_compat.TRL_VERSION}."):
        pytest.skip(f"trl {trl.__version__} installed; the allow-list is written against TRL {trl_compat.TRL_VERSION}")
    import importlib

    out = []
    def load(ref: str):
        module, _, name = ref.partition(":")
        return getattr(importlib.import_module(module), name)

    for method, record in METHODS:
        theirs_module = importlib.import_module(record.trl.partition(":")[0])
        config, trainer = f"{method}Config", f"{method}Trainer"
        our_config, our_trainer = load(record.config), load(record.trainer)
        assert (our_config.__name__, our_trainer.__name__) == (config, trainer)
        out.append(("Config", config, dataclass_types(getattr(theirs_module, config)),
                    dataclass_types(our_config), our_config))
        out.append(("Trainer", trainer, signature_types(getattr(theirs_module, trainer).__init__),
                    signature_types(our_trainer.__init__), our_trainer))
    return out


def listed(owner: str, name: str) -> bool:
    return trl_compat.unsupported_reason(owner, name) is not None or name in PENDING.get(owner, ())


def refused(kind: str, owner: str, name: str, ours: dict, our_cls) -> bool:
    """A TRL name we have but list as unsupported: a TrainingArguments field we inherit, or a trainer argument
    accepted by name only to refuse it."""
    if name not in ours or trl_compat.unsupported_reason(owner, name) is None:
        return False
    return kind == "Trainer" or inherited_from_transformers(our_cls, name)


# ------------------------------------------------------------------------------ the tests

def test_every_trl_name_is_ours_or_listed(pairs, capsys):
    missing, lines = [], []
    for kind, owner, theirs, ours, our_cls in pairs:
        missing += [f"{owner}.{n}" for n in theirs if n not in ours and not listed(owner, n)]
        have = [n for n in theirs if n in ours and not refused(kind, owner, n, ours, our_cls)]
        line = f"{owner}: {len(have)}/{len(theirs)} TRL {'fields' if kind == 'Config' else 'arguments'}"
        if kind == "Config":
            from transformers import TrainingArguments

            base = {f.name for f in dataclasses.fields(TrainingArguments)}
            own = [n for n in theirs if n not in base]
            line += f" (beyond TrainingArguments: {len([n for n in own if n in have])}/{len(own)})"
        lines.append(line)
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert not missing, (f"TRL {trl_compat.TRL_VERSION} names neither ours nor listed in "
                         f"stages.trainers.trl_compat.UNSUPPORTED (add the setting, or list it with a reason): "
                         f"{missing}")


def type_gaps(pairs) -> set[tuple[str, str]]:
    """(owner, name) of shared names whose types are not compatible."""
    out = set()
    for kind, owner, theirs, ours, _ in pairs:
        for name in set(theirs) & set(ours):
            t, o = (theirs[name], ours[name]) if kind == "Config" else (theirs[name][0], ours[name][0])
            if not compatible(t, o):
                out.add((owner, name))
    return out


def test_shared_names_have_compatible_types(pairs):
    bad = sorted(f"{o}.{n}" for o, n in type_gaps(pairs) if f"{o}.{n}" not in UNSUPPORTED)
    assert not bad, f"types incompatible with TRL's (widen ours, or list the difference in UNSUPPORTED): {bad}"


def test_positional_arguments_sit_where_trl_has_them(pairs):
    bad = [f"{owner}.{name}: TRL's position {theirs[name][1]}, ours {ours[name][1]}"
           for kind, owner, theirs, ours, _ in pairs if kind == "Trainer"
           for name in theirs if theirs[name][1] is not None and name in ours and ours[name][1] != theirs[name][1]]
    assert not bad, bad


def test_no_allow_list_entry_outlives_its_gap(pairs):
    """Each UNSUPPORTED entry names a TRL setting that is absent on our side, refused there or narrower in
    type; each PENDING name is still absent (the lead's renames delete it)."""
    gaps = {(owner, n) for kind, owner, theirs, ours, cls in pairs for n in theirs
            if n not in ours or refused(kind, owner, n, ours, cls)} | type_gaps(pairs)
    names_in_trl = {(owner, n) for _, owner, theirs, _, _ in pairs for n in theirs}
    stale = []
    for key in UNSUPPORTED:
        owner, _, name = key.rpartition(".")
        applies = {(o, n) for o, n in names_in_trl if n == name and (o == owner or not owner)}
        if not applies:
            stale.append(f"{key}: TRL {trl_compat.TRL_VERSION} has no such name")
        elif not applies & gaps:
            stale.append(f"{key}: every class that has it in TRL now has it on our side: delete the entry")
    for owner, names in PENDING.items():
        stale += [f"PENDING {owner}.{n}: now ours; delete it" for n in names if (owner, n) not in gaps]
    assert not stale, stale


def test_trainer_arguments_listed_as_unsupported_are_refused_by_name(pairs):
    """A TRL argument we accept by name only raises, naming it as TRL's, before anything is loaded."""
    checked = 0
    for kind, owner, theirs, ours, cls in pairs:
        if kind != "Trainer":
            continue
        for name in theirs:
            if refused(kind, owner, name, ours, cls):
                with pytest.raises(ValueError, match=rf"{owner}\.{name}: TRL 1\.16's `{name}` is not supported"):
                    cls(None, **{name: object()})
                checked += 1
    # every trainer argument listed is one the loop saw refused (none are left: all seven trainers take every
    # argument of TRL's)
    assert checked == len([k for k in UNSUPPORTED if k.partition(".")[0].endswith("Trainer")]) == 0


def test_stages_trainers_exports_what_from_trl_import_gives(pairs):
    import trl

    import stages.trainers as ours

    names = [f"{m}{kind}" for m, _ in METHODS for kind in ("Trainer", "Config")]
    assert all(hasattr(ours, n) for n in names)
    for name in names:
        if hasattr(trl, name):  # online DPO lives in trl.experimental in 1.16; ours is top-level
            assert getattr(ours, name).__name__ == name


# ------------------------------------------------------------------------------ bad input, without TRL

def test_unsupported_trl_fields_names_the_field_as_trls():
    from stages.trainers.grpo_trainer import GRPOConfig

    problems = unsupported_trl_fields(GRPOConfig, {"vllm_gpu_memory_utilization": 0.5, "beta": 0.1, "use_vllm": True,
                                                   "log_completions_hub_repo": "me/x"})
    assert [k for k, _ in problems] == ["vllm_gpu_memory_utilization", "log_completions_hub_repo"]
    assert re.search(r"GRPOConfig\.vllm_gpu_memory_utilization: TRL 1\.16's `vllm_gpu_memory_utilization` is not "
                     r"supported by stages\.trainers yet \(needs vLLM on a CUDA GPU: .*colocated engine.*\); "
                     r"remove it", problems[0][1])
    assert [k for k, _ in unsupported_trl_fields("OnlineDPOConfig", {"use_vllm": True})] == ["use_vllm"]


def test_unsupported_trl_fields_refuses_an_inherited_field_only_off_its_default():
    from stages.trainers.sft_trainer import SFTConfig

    assert unsupported_trl_fields(SFTConfig, {"use_liger_kernel": False}) == []
    [(key, message)] = unsupported_trl_fields(SFTConfig, {"use_liger_kernel": True})
    assert key == "use_liger_kernel" and "Triton kernels, which run on CUDA GPUs" in message
    assert unsupported_trl_fields("SFTConfig", ["use_liger_kernel", "dataset_kwargs", "packing"]) == [
        ("use_liger_kernel", trl_compat.unsupported_message("SFTConfig.use_liger_kernel", "use_liger_kernel"))]


def test_a_field_of_our_own_is_never_refused():
    """GRPOConfig declares use_vllm itself; the bare entry, there for OnlineDPOConfig, does not touch it."""
    from stages.trainers.grpo_config import GRPOConfig

    assert unsupported_trl_fields(GRPOConfig, {"use_vllm": True}) == []
    assert unsupported_trl_fields("OnlineDPOConfig", {"use_vllm": True})[0][0] == "use_vllm"


@pytest.mark.parametrize("annotation, expected", [
    ("int | None", {"int", "None"}), ("list[str] | None", {"list", "None"}), ("PreTrainedModel | str", {"object",
                                                                                                       "str"}),
    ('Literal["a", "b"]', {"str"}), (dict[str, int] | None, {"dict", "None"}),
    (typing.Optional[float], {"float", "None"}),  # noqa: UP045 (the old spelling is the case read here)
])
def test_kinds_reads_annotations_loosely(annotation, expected):
    assert kinds(annotation) == expected


def test_compatible_is_loose_but_not_blind():
    assert compatible({"int"}, {"float"}) and compatible({"int", "None"}, {"int"})
    assert compatible({"list", "None"}, {"str", "list"})
    assert not compatible({"str"}, {"int"}) and not compatible({"bool"}, {"list", "None"})
