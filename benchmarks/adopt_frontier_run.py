"""Adopt a ``kernel_frontier.py`` GPU run: its measured table into the kernel, its report into results.

    python3 benchmarks/adopt_frontier_run.py RUN_DIR [--name kernel_frontier] [--dry-run]

``RUN_DIR`` is the run's ``--out`` folder (``kernel_frontier.{json,md,png}``,
``gpu_decode_table.json``; a ``../frontier2.log`` console beside it is copied too). Each new
entry replaces the committed entry of the same shape (decode: batch and context; prefill: token
count) and other committed entries stay, so a run that covered only some shapes keeps the rest.
An entry whose best full call was not faster than the frozen baseline's full call at that shape
is *not* adopted: there the heuristics, which equal the baseline's choices, decide.
Prints what it adopted and skipped, then ``git add`` the listed files and commit.

The table is read only by the opt-in fused-write kernel (``gpu_fused.py``, ``gpu_block_sizes(fused=True)``):
its entries are timed on that kernel. The engine's default GPU kernel (``gpu.py``) takes the
baseline's heuristics over bf16/f32 pages, so adopting that table never changes the default path.

FP8 pages: a run with the ``fp8`` stage also leaves ``gpu_fp8_decode_table.json``, the default
kernel's best sizes over float8_e4m3fn pages per swept shape. Its entries are merged the same way
into ``pallas_kernels/paged_attention/gpu_fp8_decode_table.json`` (read by ``gpu_block_sizes`` when
``kv_itemsize=1``), each only where it beat the sizes the engine used for fp8 pages in the same run.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "pallas_kernels" / "paged_attention" / "gpu_decode_table.json"
FP8_TABLE = REPO / "pallas_kernels" / "paged_attention" / "gpu_fp8_decode_table.json"
RESULTS = REPO / "benchmarks" / "results"


def shape_key(entry: dict) -> tuple:
    if entry.get("kind", "decode") == "decode":
        return ("decode", entry["batch"], entry["context"], entry["group"], entry["head_dim"], entry["itemsize"])
    return ("prefill", entry["num_tokens"], entry["group"], entry["head_dim"], entry["itemsize"])


def baseline_full_us(report: dict, entry: dict) -> float | None:
    """The baseline kernel's full-call time at the entry's shape in the same run, in µs."""
    for row in report.get("results", []):
        if entry.get("kind", "decode") == "decode" and row.get("workload") == "decode" \
                and row.get("batch") == entry["batch"] and row.get("context") == entry["context"]:
            return row["baseline_full_s"] * 1e6 if row.get("baseline_full_s") else None
        if entry.get("kind") == "prefill" and row.get("workload") == "prefill" \
                and row.get("prefill_tokens") == entry.get("prefill_tokens") and row.get("chunk") == entry.get("chunk"):
            return row["baseline_full_s"] * 1e6 if row.get("baseline_full_s") else None
    return None


def merge_tables(committed: list[dict], new: list[dict], report: dict) -> tuple[list[dict], list[str]]:
    """Committed entries with the run's faster-than-baseline entries replacing theirs; and what was done."""
    merged = {shape_key(e): e for e in committed}
    notes = []
    for entry in new:
        base = baseline_full_us(report, entry)
        label = f"{shape_key(entry)}: {entry['us']:.1f} us" + (f" vs baseline {base:.1f} us" if base else "")
        if base is not None and entry["us"] >= base:
            merged.pop(shape_key(entry), None)  # an old entry there is not better than what the run saw
            notes.append(f"skipped (not faster than the baseline; heuristics decide) {label}")
            continue
        merged[shape_key(entry)] = entry
        notes.append(f"adopted {label}")
    return list(merged.values()), notes


def merge_fp8_tables(committed: list[dict], new: list[dict]) -> tuple[list[dict], list[str]]:
    """Committed fp8 entries with the run's entries that beat the engine's fp8 sizes of that run replacing theirs.

    An entry not faster than those sizes leaves the committed entry (if any) as it is: the engine's
    sizes came from it, or from the heuristics where there is none.
    """
    merged = {shape_key(e): e for e in committed}
    notes = []
    for entry in new:
        label = f"fp8 {shape_key(entry)}: {entry['us']:.1f} us vs the engine's fp8 sizes {entry['default_us']:.1f} us"
        if not entry["us"] < entry["default_us"]:
            notes.append(f"skipped (not faster than the sizes in use) {label}")
            continue
        merged[shape_key(entry)] = entry
        notes.append(f"adopted {label}")
    return list(merged.values()), notes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--name", default="kernel_frontier", help="results file stem under benchmarks/results/")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    report = json.loads((args.run_dir / "kernel_frontier.json").read_text())
    new_path = args.run_dir / "gpu_decode_table.json"
    new = json.loads(new_path.read_text())["entries"] if new_path.exists() else []
    committed = json.loads(TABLE.read_text()) if TABLE.exists() else {"source": "", "entries": []}
    entries, notes = merge_tables(committed["entries"], new, report)
    fp8_new_path = args.run_dir / "gpu_fp8_decode_table.json"
    fp8_new = json.loads(fp8_new_path.read_text())["entries"] if fp8_new_path.exists() else []
    fp8_committed = json.loads(FP8_TABLE.read_text()) if FP8_TABLE.exists() else {"source": "", "entries": []}
    fp8_entries, fp8_notes = merge_fp8_tables(fp8_committed["entries"], fp8_new)
    notes += fp8_notes
    print("\n".join(notes) or "no new entries")
    source = (f"benchmarks/kernel_frontier.py on {report['device']}, {report['date']} (jax {report['jax']}), merged "
              f"over earlier runs; an entry only where it beat the frozen baseline kernel")
    fp8_source = (f"benchmarks/kernel_frontier.py --only fp8 on {report['device']}, {report['date']} (jax "
                  f"{report['jax']}), merged over earlier runs; an entry only where it beat the engine's fp8 sizes")
    if args.dry_run:
        print(json.dumps({"source": source, "entries": entries}, indent=1))
        print(json.dumps({"source": fp8_source, "entries": fp8_entries}, indent=1))
        return
    copied = []
    if new:  # an fp8-only run leaves the fused kernel's table (and its source line) as they are
        TABLE.write_text(json.dumps({"source": source, "entries": entries}, indent=1) + "\n")
        copied.append(TABLE)
    if fp8_entries != fp8_committed["entries"]:
        FP8_TABLE.write_text(json.dumps({"source": fp8_source, "entries": fp8_entries}, indent=1) + "\n")
        copied.append(FP8_TABLE)
    for suffix in ("json", "md", "png"):
        src = args.run_dir / f"kernel_frontier.{suffix}"
        if src.exists():
            shutil.copyfile(src, RESULTS / f"{args.name}.{suffix}")
            copied.append(RESULTS / f"{args.name}.{suffix}")
    logs = sorted(args.run_dir.parent.glob(f"{args.run_dir.name}.log"))
    if logs:
        shutil.copyfile(logs[0], RESULTS / f"{args.name}.log")
        copied.append(RESULTS / f"{args.name}.log")
    print("wrote:\n  " + "\n  ".join(str(p.relative_to(REPO)) for p in copied))


if __name__ == "__main__":
    main()
