"""Coverage-guided fuzzing of the `.colibri` reader with atheris (optional: `pip install atheris`).

    python -m tests.fuzz.atheris_format -atheris_runs=200000 -max_len=131072 -rss_limit_mb=4096 -timeout=5 \
        -artifact_prefix=tests/fuzz/crashes/ [CORPUS_DIR ...]
    python -m tests.fuzz.atheris_format tests/fuzz/crashes/crash-...        # replay one input

libFuzzer drives the bytes; a fraction of inputs are re-sealed (section checksums recomputed) so coverage
can grow past the checksums. Only ColibriFormatError is caught: anything else is a crash that libFuzzer
reports and saves. Starting seeds are the valid files of the mutation fuzzer (written to a temp corpus
directory when no corpus directory is given).
"""

from __future__ import annotations

import atexit
import os
import resource
import shutil
import sys
import tempfile
from pathlib import Path

import atheris


with atheris.instrument_imports():
    import colibri_format
    from colibri_format import errors as E
    from colibri_format.inspect import validate_file
    from colibri_format.reader import load_tables

from tests.spec import craft

_SCRATCH = tempfile.mkdtemp(prefix="colibri-atheris-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
_PATH = os.path.join(_SCRATCH, "input.colibri")
atexit.register(shutil.rmtree, _SCRATCH, True)


def test_one_input(data: bytes) -> None:
    buf = bytearray(data)
    if buf[:1] and buf[-1] & 1 and len(buf) >= 512:      # half the inputs: re-seal so deeper checks run
        try:
            craft.fix_section_checksums(buf)
        except Exception:
            pass
    with open(_PATH, "wb") as fh:
        fh.write(buf)
    try:
        load_tables(_PATH)
    except E.ColibriFormatError:
        pass
    try:
        with colibri_format.open(_PATH) as f:
            for name in f.dense_names()[:2]:
                try:
                    f.dense_f32(name)
                except E.CorruptTensor:
                    pass
            try:
                f.expert_f32(f.tables.plan.moe_layers[0], 0)
            except E.CorruptExpert:
                pass
    except E.ColibriFormatError:
        pass
    validate_file(_PATH)


def main() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    import numpy as np
    np.seterr(all="ignore")
    argv = list(sys.argv)
    if not any(not a.startswith("-") for a in argv[1:]):
        corpus = Path(tempfile.mkdtemp(prefix="colibri-atheris-corpus-"))
        atexit.register(shutil.rmtree, corpus, True)
        from tests.fuzz.fuzz_format import make_seeds
        for i, seed in enumerate(make_seeds()):
            (corpus / f"seed{i}.colibri").write_bytes(seed)
        argv.append(str(corpus))
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
