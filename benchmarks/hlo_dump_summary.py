"""What fills an XLA dump: per optimized module, its size, its custom calls by target (with the
bytes of their configs) and its largest instructions, as JSON (a dump is too large to bring back).

    python3 benchmarks/hlo_dump_summary.py DUMP_DIR > summary.json

Written for the static-scale FP8 engine's step programs, whose optimized HLO text ran to 39-85 MB
at 2048-8192 token rows on an H200 against ~4 MB at 1024 (session 13's compile_time dump).
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

TARGET = re.compile(r'custom_call_target="([^"]+)"')
OPCODE = re.compile(r"=\s*\S+\s+([\w\-]+)\(")


def summarize(path: Path, top: int = 8) -> dict:
    calls: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    opcodes: collections.Counter = collections.Counter()
    largest = []
    with path.open(errors="replace") as f:
        for line in f:
            opcode = OPCODE.search(line)
            if opcode:
                opcodes[opcode.group(1)] += 1
            target = TARGET.search(line)
            if target:
                calls[target.group(1)][0] += 1
                calls[target.group(1)][1] += len(line)
            largest.append((len(line), line[:160].strip()))
            largest = sorted(largest, reverse=True)[:top]
    return {"file": path.name, "bytes": path.stat().st_size, "opcodes": dict(opcodes.most_common(15)),
            "custom_calls": {t: {"count": c, "bytes": b} for t, (c, b) in calls.items()},
            "largest_lines": [{"bytes": n, "start": text} for n, text in largest]}


def main() -> None:
    files = sorted(Path(sys.argv[1]).glob("*after_optimizations.txt"), key=lambda p: -p.stat().st_size)
    json.dump([summarize(p) for p in files[:6]], sys.stdout, indent=1)


if __name__ == "__main__":
    main()
