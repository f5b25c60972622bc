"""Folds an OpInfo run into tests/expected_failures.txt.

    python -m pytest tests/test_opinfo.py --opinfo-record=/tmp/rec.txt
    python tests/update_expected_failures.py /tmp/rec.txt          # rewrites the file
    python tests/update_expected_failures.py /tmp/rec.txt --check  # prints, writes nothing

Lines for tests that now pass (XPASS) are deleted (a wildcard line is expanded first);
new failures are appended to their section. Review the diff: a new failure is a bug to
report, not something to hide.
"""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import test_opinfo as T  # noqa: E402

SECTIONS = [
    ("skip", "Cannot compare with the CPU (skipped)"),
    ("rng", "Needs torch.tpu.get_rng_state/set_rng_state (OpInfo calls freeze_rng_state)"),
    ("fallback", "A native rule exists but the OpInfo (or its backward) still uses the CPU fallback"),
    ("bug", "Wrong results or errors (bugs)"),
]


def classify(reason):
    """(section, skip?, reason) for a recorded failure."""
    if "copy of a dtype the tpu device does not support" in reason or "ComplexHalf" in reason:
        return "skip", True, "complex dtype: the tpu device has no complex support"
    if re.search(r"Sparse(Csr)?tpu", reason):
        return "skip", True, "sparse layout: the tpu device has strided tensors only"
    if "Jiterator" in reason:
        return "skip", True, "CUDA only (jiterator)"
    if "get_rng_state" in reason:
        return "rng", False, "torch.tpu has no get_rng_state"
    if reason.startswith("falls back:"):
        return "fallback", False, reason
    return "bug", False, reason


def main(rec_path, check=False):
    by_op = {}
    for c in T.CASES:
        name, dt, d = c.values
        by_op.setdefault(name, []).append((dt, d))

    recorded = []
    for line in Path(rec_path).read_text().splitlines():
        m = re.match(r"^(\S+) (\S+) (\S+)  # (.*)$", line)
        if m:
            recorded.append(m.groups())
    xpass = {(op, dt, d) for op, dt, d, r in recorded if r.startswith("XPASS")}

    # Edit the file line by line so hand-written sections and comments survive.
    lines = Path(T.EXPECTED_FILE).read_text().splitlines()
    out, kept = [], []
    for raw in lines:
        m = T._LINE.match(raw.strip())
        if not m or raw.strip().startswith("#"):
            out.append(raw)
            continue
        op, dt, d, skip, reason = m.groups()
        hit = [k for k in xpass if k[0] == op and dt in (k[1], "*") and d in (k[2], "*")]
        if not hit:
            out.append(raw)
            kept.append((op, dt, d))
        elif "*" in (dt, d):  # expand the wildcard, minus what passes now
            for cdt, cd in by_op.get(op, []):
                if dt in (cdt, "*") and d in (cd, "*") and (op, cdt, cd) not in xpass:
                    out.append(f"{op} {cdt} {cd}{skip or ''}  # {reason}")
                    kept.append((op, cdt, cd))

    def covered(op, dt, d):
        return any(k[0] == op and k[1] in (dt, "*") and k[2] in (d, "*") for k in kept)

    new = {}
    for op, dt, d, reason in recorded:
        if reason.startswith("XPASS") or covered(op, dt, d):
            continue
        key, skip, r = classify(reason)
        new.setdefault(key, []).append(f"{op} {dt} {d}{' skip' if skip else ''}  # {r}")
    for key, title in SECTIONS:
        if key not in new:
            continue
        head = f"# --- {title}"
        at = out.index(head) + 1 if head in out else None
        if at is None:
            out += ["", head]
            at = len(out)
        while at < len(out) and out[at].strip():
            at += 1
        out[at:at] = new[key]

    result = "\n".join(out).rstrip("\n") + "\n"
    if check:
        print(result)
    else:
        Path(T.EXPECTED_FILE).write_text(result)
        print(f"{T.EXPECTED_FILE}: {len(xpass)} XPASS removed, "
              f"{sum(map(len, new.values()))} new failures added")


if __name__ == "__main__":
    main(sys.argv[1], check="--check" in sys.argv[2:])
