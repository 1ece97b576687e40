"""Where a model comes from, checked in seconds: `model_source_problem` says why `model.name_or_path`
(a folder or a hub id) cannot be loaded, before any training (params validation calls it), instead
of `from_pretrained` retrying the hub for a minute and never naming the missing folder.
"""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path

# org/name, as the hub spells repository ids; anything else that is not a folder is a missing folder
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
HUB_TIMEOUT_S = 3.0


def model_source_problem(name: str, *, cache_dir: str | Path | None = None, trust_remote_code: bool = False
                         ) -> str | None:
    """Why `name` (not a builtin) cannot be loaded, or None: checked in seconds, before any training.

    A folder must hold a config.json. A name that is not a folder is taken for a hub id only if it
    looks like one (`org/name`) and is in the local Hugging Face cache or the hub answers within
    HUB_TIMEOUT_S: `from_pretrained` would otherwise retry for about a minute and then report a network
    error that never mentions the missing folder. When the hub does not answer, a cached id is loaded
    with HF_HUB_OFFLINE set, so that it does not retry either. A model whose config or tokenizer config needs
    custom code (`auto_map`) is refused unless `trust_remote_code` (`remote_code_problem`).
    """
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").exists():
            return ("folder has no config.json; point it at a Hugging Face model directory (one written by "
                    "save_pretrained)")
        return None if trust_remote_code else remote_code_problem(path)
    where = f"no folder {path.resolve()}"
    if not HUB_ID.match(name):  # ./x, ../x, ~/x, /x, a/b/c, x
        return f"{where}; not a hub id (org/name) either, so the hub was not tried. Fix the path"
    if in_hub_cache(name, cache_dir):
        if not hub_reachable():
            go_offline()
        return None if trust_remote_code else remote_code_problem(cached_folder(name, cache_dir))
    fix = (f"Fix the path, or download the model where the hub is reachable (`hf download {name} --local-dir "
           f"models/{name.split('/')[-1]}`) and point model.name_or_path at that folder")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return f"{where}, and hub id {name!r} is not in the local Hugging Face cache; the hub was not tried " \
               f"(HF_HUB_OFFLINE is set). {fix}"
    url = hub_endpoint()
    if reason := hub_unreachable_reason(url):
        return (f"{where}, and hub id {name!r} is not in the local Hugging Face cache; the hub ({url}) is not "
                f"reachable ({reason}). {fix}")
    return None


CODE_CONFIGS = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")


def remote_code_problem(folder: Path | None) -> str | None:
    """Why a model folder cannot load without model.trust_remote_code: one of its configs names custom classes
    (`auto_map`), whose code `from_pretrained` would import from the folder (or fetch from the hub) and run.
    Checked before anything is loaded, so no such code runs and no download is attempted."""
    import json

    for name in CODE_CONFIGS if folder is not None else ():
        assert folder is not None  # no names to loop over without a folder
        try:
            config = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        auto_map = config.get("auto_map") if isinstance(config, dict) else None
        if auto_map:
            classes = ", ".join(f"{k} -> {v if isinstance(v, str) else v[0]}" for k, v in dict(auto_map).items())
            return (f"{name} needs custom code (auto_map: {classes}), and model.trust_remote_code is false: "
                    "loading would run code from the model folder. Read that code, then set model.trust_remote_code: "
                    "true if you trust it, or use a model transformers supports natively")
    return None


def cached_folder(repo_id: str, cache_dir: str | Path | None = None) -> Path | None:
    """The snapshot folder of a cached hub id (where its config.json lies)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir)
    return Path(found).parent if isinstance(found, str) else None


def in_hub_cache(repo_id: str, cache_dir: str | Path | None = None) -> bool:
    """Whether the local Hugging Face cache holds `repo_id`'s config.json (what from_pretrained reads first)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir), str)


def go_offline() -> None:
    """No more hub requests in this process (and its children): loading a cached id must not retry for a minute."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True  # read once, when huggingface_hub was imported


def hub_endpoint() -> str:
    """HF_ENDPOINT (a mirror) or the hub."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or constants.ENDPOINT


def hub_reachable(url: str | None = None) -> bool:
    return hub_unreachable_reason(url or hub_endpoint()) is None


@functools.cache
def hub_unreachable_reason(url: str, timeout: float = HUB_TIMEOUT_S) -> str | None:
    """Why `url` did not answer HTTP within `timeout` seconds (name lookup included), or None if it did."""
    import threading
    import urllib.error
    import urllib.request

    answer: list[str | None] = []

    def probe():
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout)
            answer.append(None)
        except urllib.error.HTTPError:  # it answered, with an error status: reachable
            answer.append(None)
        except urllib.error.URLError as e:
            answer.append(str(e.reason))
        except (OSError, ValueError) as e:
            answer.append(str(e) or type(e).__name__)

    thread = threading.Thread(target=probe, daemon=True)  # a name lookup ignores the socket timeout
    thread.start()
    thread.join(timeout)
    return answer[0] if answer else f"no answer within {timeout:.0f} s"
