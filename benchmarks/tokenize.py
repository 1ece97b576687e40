"""Peak memory and seconds of SFT tokenisation: the whole list then `Dataset.from_list` (before) against
`Dataset.map(batched=True, num_proc=N)` cached as Arrow files (after: stages.data.tokenize.tokenized_dataset).

    python -m benchmarks tokenize                 # 200,000 synthetic chat rows; num_proc 1 and 2
    python -m benchmarks tokenize --tiny          # 2,000 rows: a quick check that every variant runs
    python -m benchmarks tokenize --rows 50000 --num-proc 1 2 4

The rows are synthetic conversations (a user turn of 20-60 words, an assistant turn of 30-90) written to a
.jsonl file, tokenised with the built-in byte-level BPE tokenizer and its chat template at max_length 512,
as `SFTTrainer._prepare` does. Each variant runs in a fresh process; the table gives the seconds of the
tokenising call, the peak resident memory it added above what the process held before it (VmHWM, reset first:
benchmarks/common.py), the process's peak, and the peak of the largest worker process (num_proc > 1; the
workers are forked, so their resident memory includes pages shared with the parent). The variants:

    before           rows read as dicts (as the pipeline's sft stage reads them), tokenised as one list,
                     then Dataset.from_list: the trainers' code before tokenising moved to datasets
    after np=N       the same rows through Dataset.map over N processes into an empty Arrow cache
    after np=1 warm  the same call again in a fresh process: the cache file is read back
    after arrow np=N the rows as a memory-mapped Dataset (datasets.load_dataset("json")) instead of dicts

Every variant must give the same tokens (a checksum is compared), or the benchmark fails.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

WORDS = ("the model learns to add numbers carry digits from right to left and writes every column sum before "
         "giving the final answer which is checked against the reference while the reward stays high").split()
MAX_LENGTH = 512


def write_rows(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            user = " ".join(rng.choices(WORDS, k=rng.randint(20, 60)))
            assistant = " ".join(rng.choices(WORDS, k=rng.randint(30, 90)))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{i}: {user}"},
                                             {"role": "assistant", "content": assistant}]}) + "\n")


def child(variant: str, workdir: Path, num_proc: int) -> dict:
    """One variant in this process: {seconds, extra_mib, peak_mib, rows, checksum}."""
    import datasets
    from transformers import AutoTokenizer

    from benchmarks.common import PeakMemory, status_mib
    from stages.data import read_jsonl
    from stages.data.formats import normalise
    from stages.data.tokenize import tokenize_sft, tokenized_dataset
    from stages.trainers.sft_trainer import _tokenize_checked, check_targets

    datasets.disable_progress_bars()
    datasets.config.HF_DATASETS_CACHE = workdir / "cache"
    tok = AutoTokenizer.from_pretrained(workdir / "tokenizer")
    tokenize = partial(tokenize_sft, tok, max_length=MAX_LENGTH)
    if variant == "arrow":
        rows = datasets.load_dataset("json", data_files=str(workdir / "rows.jsonl"), split="train",
                                     cache_dir=str(workdir / "cache")).map(
            lambda r: normalise("messages", r), remove_columns=["messages"])
    else:
        rows = [normalise("messages", r) for r in read_jsonl(workdir / "rows.jsonl")]
    cached = {str(p) for p in (workdir / "cache" / "align-tokenized").glob("*.arrow")}
    memory = PeakMemory("cpu")
    memory.start()
    start = time.perf_counter()
    if variant == "before":
        tokens = tokenize(rows)
        check_targets(tokens, MAX_LENGTH)
        out = datasets.Dataset.from_list(tokens)
        del tokens
    else:
        out = tokenized_dataset(rows, partial(_tokenize_checked, tokenize, MAX_LENGTH), marker="input_ids",
                                tokenizer=tok, num_proc=num_proc)
    seconds = time.perf_counter() - start
    extra = memory.peak()
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the largest worker process's peak
    digest = hashlib.sha256()
    for batch in out.iter(batch_size=10_000):
        digest.update(json.dumps([batch["input_ids"], batch["completion_mask"]]).encode())
    return {"seconds": round(seconds, 2), "extra_mib": round(extra, 1), "peak_mib": round(status_mib("VmHWM"), 1),
            "worker_mib": round(workers, 1), "rows": len(out), "checksum": digest.hexdigest()[:16],
            "from_cache": variant != "before" and {f["filename"] for f in out.cache_files} <= cached}


def run_child(variant: str, workdir: Path, num_proc: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                     os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-m", "benchmarks.tokenize", "--child", variant, "--workdir", str(workdir),
                          "--num-proc", str(num_proc)], capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"variant {variant} (num_proc {num_proc}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


def run(argv: list[str] | None = None) -> list[dict]:
    """The benchmark's rows ({variant, seconds, extra_mib, peak_mib, worker_mib, rows, checksum}), printed too."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--tiny", action="store_true", help="2,000 rows (a check that every variant runs)")
    parser.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, Path(args.workdir), args.num_proc[0])))
        return []
    n = 2_000 if args.tiny else args.rows
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        from stages.builtin import tiny

        tiny.build_tokenizer(384).save_pretrained(workdir / "tokenizer")
        write_rows(workdir / "rows.jsonl", n)
        plan = [("before", "before", 1)]
        for num_proc in args.num_proc:
            plan.append((f"after np={num_proc}", "after", num_proc))
            if num_proc == 1:
                plan.append(("after np=1 warm", "after", 1))  # the cache written by the line above
        plan += [(f"after arrow np={p}", "arrow", p) for p in args.num_proc[-1:]]
        results = []
        for label, variant, num_proc in plan:
            if variant != "after" or not label.endswith("warm"):
                for stale in (workdir / "cache").glob("align-tokenized/*"):
                    stale.unlink()  # a cold cache: every variant but "warm" tokenises
            results.append({"variant": label, **run_child(variant, workdir, num_proc)})
    load = os.getloadavg()[0]
    print(f"SFT tokenisation of {n:,} chat rows (built-in BPE tokenizer, max_length {MAX_LENGTH}); "
          f"load average {load:.2f} on {os.cpu_count()} cores")
    print(f"{'variant':<20} {'seconds':>8} {'extra MiB':>10} {'peak MiB':>9} {'worker MiB':>11} {'rows':>8}  checksum")
    for r in results:
        print(f"{r['variant']:<20} {r['seconds']:>8.2f} {r['extra_mib']:>10.1f} {r['peak_mib']:>9.1f} "
              f"{r['worker_mib']:>11.1f} {r['rows']:>8}  {r['checksum']}")
    if len({r["checksum"] for r in results}) != 1:
        raise SystemExit("the variants gave different tokens")
    return results


if __name__ == "__main__":
    raise SystemExit(main())
