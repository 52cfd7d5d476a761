#!/usr/bin/env python3
"""Sort a sanitizer log into findings that involve convfuse's extension and the rest.

Python itself leaks a few kilobytes at exit and the dynamic loader trips valgrind's
strncmp check; neither is ours. A finding is ours when any frame of its stack is in
convfuse._cudnn (csrc/, `convfuse::`, `_cudnn.cpython`). Any AddressSanitizer memory error
counts wherever it is, since it can stem from a wrong argument we passed.

    python scripts/sanitizer_report.py asan LOG...      # ASan/LSan log_path files
    python scripts/sanitizer_report.py valgrind LOG     # valgrind --log-file

Prints a summary and exits 1 if anything is ours (or ASan found a memory error).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

OURS = re.compile(r"_cudnn\.cpython|csrc/|convfuse::")


def asan_findings(text: str) -> tuple[list[str], list[str], int]:
    """(memory errors, leaks through our code, other leaked bytes) from an ASan/LSan log."""
    errors = [m.group(0) for m in re.finditer(r"ERROR: AddressSanitizer: [^\n]+", text)]
    ours, other_bytes = [], 0
    for block in re.split(r"\n\s*\n", text):
        m = re.search(r"(Direct|Indirect) leak of (\d+) byte", block)
        if not m:
            continue
        if OURS.search(block):
            ours.append(block.strip())
        else:
            other_bytes += int(m.group(2))
    return errors, ours, other_bytes


def valgrind_findings(text: str) -> tuple[list[str], int, int]:
    """(records involving our code, other error records, other definitely-lost bytes)."""
    records = re.split(r"\n==\d+== ?\n", text)
    ours, other_errors, other_lost = [], 0, 0
    for rec in records:
        lines = [re.sub(r"^==\d+== ?", "", ln) for ln in rec.splitlines()]
        body = "\n".join(lines).strip()
        if not body:
            continue
        head = body.splitlines()[0]
        lost = re.match(r"([\d,]+) (?:\([\d,]+ direct, [\d,]+ indirect\) )?bytes in [\d,]+ "
                        r"blocks are definitely lost", head)
        is_error = re.match(r"(Invalid|Conditional jump|Use of uninitialised|Syscall param|"
                            r"Mismatched|Source and destination|Argument)", head)
        if not (lost or is_error):
            continue
        if OURS.search(body):
            ours.append(body)
        elif lost:
            other_lost += int(lost.group(1).replace(",", ""))
        else:
            other_errors += 1
    return ours, other_errors, other_lost


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("asan", "valgrind"):
        print(__doc__, file=sys.stderr)
        return 2
    text = "\n\n".join(Path(p).read_text(errors="replace") for p in argv[1:])
    if argv[0] == "asan":
        errors, ours, other = asan_findings(text)
        for e in errors:
            print(f"ASan memory error: {e}")
        for block in ours:
            print(f"leak through convfuse._cudnn:\n{block}\n")
        print(f"ASan: {len(errors)} memory error(s), {len(ours)} leak(s) through "
              f"convfuse._cudnn; {other} byte(s) leaked elsewhere (the interpreter at exit)")
        return 1 if errors or ours else 0
    ours, other_errors, other_lost = valgrind_findings(text)
    for rec in ours:
        print(f"valgrind finding in convfuse._cudnn:\n{rec}\n")
    print(f"valgrind: {len(ours)} finding(s) involving convfuse._cudnn; elsewhere "
          f"{other_errors} error record(s) (the interpreter and the dynamic loader) and "
          f"{other_lost} byte(s) definitely lost")
    return 1 if ours else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
