"""Crash safety and resume of `colibri convert`: SIGKILL (deterministic points and random times), Ctrl-C,
file-size limits and disk full, a changed input, a torn journal and a damaged `.part`.

Invariant checked everywhere: nothing appears at the destination before the conversion completes, and
the finished file is byte-identical to an uninterrupted run. Note that kill -9 keeps the page cache, so
these tests cannot show fsync ordering; `test_durable_order` checks that order on the recorded I/O steps.
"""

from __future__ import annotations

import errno
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash

from colibri_format.cli import main as cli_main
from colibri_format.convert import crashpoint, journal
from colibri_format.convert.journal import (frame, journal_path_for, lock_path_for, parse_records,
                                            read_journal)
from colibri_format.convert.pipeline import convert
from colibri_format.errors import ResumeError, WriteError
from colibri_format.inspect import validate_file
from colibri_format.writer import part_path_for

from tests.convert.synth_checkpoint import mixtral_config, write_checkpoint
from tests.subprocesses import default_sigint

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
ENV.pop("COLIBRI_CRASH_AT", None)


def _digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        while chunk := fh.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def _cli(ckpt: Path, out: Path, *extra: str, env: dict | None = None) -> list[str]:
    return [sys.executable, "-m", "colibri_format", "convert", "--model-path", str(ckpt), "--output-path",
            str(out), "--quiet", *extra]


def _leftovers(out: Path) -> list[str]:
    names = {part_path_for(out).name, journal_path_for(out).name, lock_path_for(out).name,
             journal_path_for(out).name + ".new"}
    return sorted(p.name for p in out.parent.iterdir() if p.name in names)


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory) -> Path:
    """8 experts x 2 layers of 4 KiB blobs: every crash point runs in well under a second."""
    d = tmp_path_factory.mktemp("small")
    write_checkpoint(d, mixtral_config(vocab=128, hidden=64, layers=2, experts=8, inter=32, heads=4),
                     shard_bytes=48 << 10)
    return d


@pytest.fixture(scope="module")
def small_clean(small_ckpt, tmp_path_factory) -> tuple[str, int]:
    """(digest of the uninterrupted output, number of crash points it passes)."""
    out = tmp_path_factory.mktemp("small_clean") / "m.colibri"
    crashpoint.reset()
    convert(small_ckpt, out, workers=1)
    return _digest(out), crashpoint.count()


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory) -> Path:
    """~400 MB of bf16 in four shards: a one-worker CLI conversion takes one to two seconds."""
    d = tmp_path_factory.mktemp("big")
    write_checkpoint(d, mixtral_config(vocab=4096, hidden=512, layers=8, experts=16, inter=1024),
                     shard_bytes=96 << 20)
    return d


@pytest.fixture(scope="module")
def big_clean(big_ckpt, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("big_clean") / "m.colibri"
    convert(big_ckpt, out, workers=2)
    return _digest(out)


# --- journal framing -------------------------------------------------------------------------------
def test_torn_and_corrupt_records_end_the_journal():
    recs = [{"kind": "header", "n": 1}, {"kind": "expert", "layer": 0}, {"kind": "dense", "name": "x"}]
    data = b"".join(frame(r) for r in recs)
    assert parse_records(data) == (recs, len(data))
    for cut in range(1, len(frame(recs[-1]))):
        got, used = parse_records(data[:-cut])
        assert got == recs[:2] and used == len(data) - len(frame(recs[-1]))
    flipped = bytearray(data)
    flipped[len(frame(recs[0])) + 20] ^= 1  # inside the second record's payload
    assert parse_records(bytes(flipped))[0] == recs[:1]
    huge_len = bytearray(data)
    huge_len[0:8] = (1 << 40).to_bytes(8, "little")  # length field no longer matches its checksum
    assert parse_records(bytes(huge_len)) == ([], 0)


# --- deterministic crash points ----------------------------------------------------------------------
def test_crash_at_every_kind_of_io_point_then_resume(small_ckpt, small_clean, tmp_path):
    clean, points = small_clean
    assert points > 10
    chosen = sorted({1, 2, 3, 4, 5, points // 3, points // 2, (2 * points) // 3, points - 3, points - 2,
                     points - 1, points})
    for n in chosen:
        out = tmp_path / f"crash{n}" / "m.colibri"
        out.parent.mkdir()
        done = subprocess.run(_cli(small_ckpt, out, "--workers", "1"), env={**ENV, "COLIBRI_CRASH_AT": str(n)},
                              capture_output=True, timeout=120)
        assert done.returncode == -signal.SIGKILL, (n, done.stderr[-2000:])
        if n < points:  # the last point is after the rename: the file is complete there
            assert not out.exists(), n
        convert(small_ckpt, out, workers=2, force=n == points)  # a finished file is replaced only when asked
        assert _digest(out) == clean, n
        assert _leftovers(out) == [], n


def test_durable_order(small_ckpt, tmp_path, monkeypatch):
    """Journal records are appended only after an fsync of the data they describe."""
    events = []
    real_hit = crashpoint.hit
    monkeypatch.setattr(crashpoint, "hit", lambda what: (events.append(what), real_hit(what)))
    convert(small_ckpt, tmp_path / "o.colibri", workers=3)
    appends = [i for i, e in enumerate(events) if e == "journal-append"]
    assert appends
    for i in appends:
        data_events = [e for e in events[:i] if e.startswith("data-")]
        assert data_events[-1] == "data-fsync"
        assert events[i + 1] == "journal-fsync"
    assert events.index("finalize") > max(appends)


# --- random kills, Ctrl-C ----------------------------------------------------------------------------
def test_random_sigkills_then_resume_is_byte_identical(big_ckpt, big_clean, tmp_path):
    """Kills at random times: odd rounds only once more pieces are journaled, so resume has work to keep."""
    out = tmp_path / "m.colibri"
    rng = random.Random(1234)
    # The kill times are fractions of one uninterrupted run, however fast the converter and the machine are.
    start = time.monotonic()
    subprocess.run(_cli(big_ckpt, tmp_path / "timing.colibri", "--workers", "1"), env=ENV, check=True, timeout=120)
    full = time.monotonic() - start
    kills, rc, most_saved = 0, None, 0
    for round_ in range(12):
        # --force: a round killed between the rename and its exit leaves a complete file to replace
        proc = subprocess.Popen(_cli(big_ckpt, out, "--workers", "1", "--force"), env=ENV,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if round_ % 2:
            _wait_for_journal_pieces(journal_path_for(out), proc, minimum=len(_journaled(out)) + 1)
            time.sleep(rng.uniform(0.0, 0.05) * full)
        else:
            time.sleep(rng.uniform(0.05, 0.6) * full)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        rc = proc.wait(timeout=120)
        if rc == 0:
            if kills >= 2:
                break
            # Done before its kill (the timing run was slow, e.g. under other I/O): the file must be complete;
            # convert it again from scratch (--force), killing sooner.
            assert _digest(out) == big_clean
            full /= 2
            continue
        assert rc == -signal.SIGKILL, proc.stderr.read()[-2000:]
        # Killed after the rename (between it and the exit) the file is there, and complete.
        assert not out.exists() or _digest(out) == big_clean
        most_saved = max(most_saved, len(_journaled(out)))
    assert kills >= 2 and most_saved > 0
    if rc != 0:
        saved = len({(r.get("name"), r.get("layer"), r.get("expert")) for r in _journaled(out)})
        # A kill between the rename and the journal's removal leaves the finished file and no .part:
        # nothing is left to resume then, and the next run converts again (to the same bytes).
        had_part = part_path_for(out).exists()
        summary = convert(big_ckpt, out, force=True)  # the file may be complete already (killed after the rename)
        assert summary.pieces_resumed == (saved if had_part else 0)
    assert _digest(out) == big_clean
    assert _leftovers(out) == []


def _journaled(out: Path) -> list:
    return read_journal(journal_path_for(out)).pieces


def _wait_for_journal_pieces(path: Path, proc: subprocess.Popen, minimum: int = 1, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if len(read_journal(path).pieces) >= minimum:
            return
        time.sleep(0.02)
    if proc.poll() == 0:            # finished between two looks (a loaded machine): nothing left to interrupt
        return
    stderr = proc.stderr.read().decode()[-2000:] if proc.poll() is not None and proc.stderr else ""
    raise AssertionError(f"the conversion wrote no journal records in time {stderr}")


def test_ctrl_c_exits_130_and_resumes(big_ckpt, big_clean, tmp_path):
    out = tmp_path / "m.colibri"
    # SIGINT's default disposition in the child even when this run inherited it ignored (a job started with `&`
    # from a non-interactive shell ignores SIGINT, and so would the converter: it would never see the Ctrl-C)
    proc = subprocess.Popen(_cli(big_ckpt, out, "--workers", "1"), env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, preexec_fn=default_sigint)
    _wait_for_journal_pieces(journal_path_for(out), proc)
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=60)
    stderr = proc.stderr.read().decode()
    assert rc == 130, stderr[-2000:]
    assert "Traceback" not in stderr
    assert not out.exists() and not lock_path_for(out).exists()
    state = read_journal(journal_path_for(out))
    assert state.header is not None and state.pieces
    summary = convert(big_ckpt, out)
    assert summary.pieces_resumed >= len(state.pieces) - 1
    assert _digest(out) == big_clean


# --- file size limit, disk full ---------------------------------------------------------------------
def _limited(limit: int):
    def setup():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return setup


def _planned_sizes(ckpt: Path) -> tuple[int, int]:
    """(end of the expert blobs, final file size) of the default conversion."""
    from colibri_format import spec as S
    from colibri_format.convert.adapters import get_adapter
    from colibri_format.convert.source import open_checkpoint
    from colibri_format.writer import ColibriWriter

    with open_checkpoint(ckpt) as src:
        model = get_adapter(src.config.model_type).normalize_config(src.config.raw)
    tmp = ckpt.parent / "plan_probe.colibri"
    w = ColibriWriter(tmp, model, dense_dtype=S.DType.F16, expert_format=S.ExpertFormat.INT8_ROW)
    w.abort(remove_part=True)
    return w.plan.metadata_offset, w.plan.metadata_offset + 4096


@pytest.mark.parametrize("where", ["at-open", "at-finalize"])
def test_file_size_limit_is_a_clear_error_then_resume(small_ckpt, small_clean, tmp_path, where):
    out = tmp_path / "m.colibri"
    data_end, _ = _planned_sizes(small_ckpt)
    limit = 16 << 10 if where == "at-open" else data_end + 1
    done = subprocess.run(_cli(small_ckpt, out), env=ENV, preexec_fn=_limited(limit), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "error:" in done.stderr and "Traceback" not in done.stderr
    assert "File too large" in done.stderr or "size limit" in done.stderr
    assert not out.exists() and not lock_path_for(out).exists()
    if where == "at-finalize":  # every piece was journaled before the limit hit
        assert len(read_journal(journal_path_for(out)).pieces) == 2 * 8 + 3 + 2 * 7
    summary = convert(small_ckpt, out)
    assert _digest(out) == small_clean[0]
    assert summary.pieces_resumed == (33 if where == "at-finalize" else 0)


def test_enospc_mid_way_keeps_the_journal(small_ckpt, small_clean, tmp_path, monkeypatch):
    out = tmp_path / "m.colibri"
    real_pwrite = os.pwrite
    calls = {"n": 0, "limit": None}

    def full_after_some(fd, data, offset):
        calls["n"] += 1
        if calls["limit"] is not None and calls["n"] > calls["limit"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full_after_some)
    convert(small_ckpt, tmp_path / "count.colibri", workers=2)  # how many writes a whole run makes
    assert calls["n"] > 10
    calls.update(n=0, limit=calls["n"] * 2 // 3)  # the disk fills two thirds of the way through
    with pytest.raises(WriteError, match="No space left"):
        convert(small_ckpt, out, workers=2)
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    assert not out.exists() and not lock_path_for(out).exists()
    saved = read_journal(journal_path_for(out)).pieces
    assert saved
    summary = convert(small_ckpt, out)
    assert summary.pieces_resumed == len({(r.get("name"), r.get("layer"), r.get("expert")) for r in saved})
    assert _digest(out) == small_clean[0]


def test_cli_enospc_exit_code(small_ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(os, "pwrite", lambda fd, data, off: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    rc = cli_main(["convert", "--model-path", str(small_ckpt), "--output-path", str(tmp_path / "m.colibri")])
    assert rc == 1
    assert "No space left on device" in capsys.readouterr().err
    assert not (tmp_path / "m.colibri").exists()


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip() or done.returncode}")
    yield mnt
    subprocess.run(["umount", str(mnt)], capture_output=True)


def test_real_disk_full_on_tmpfs(small_ckpt, small_clean, small_tmpfs, monkeypatch):
    out = small_tmpfs / "m.colibri"
    # 1. The early check names the bytes needed.
    with pytest.raises(WriteError, match="more bytes"):
        convert(small_ckpt, out)
    # 2. Past the check, the kernel's ENOSPC mid-way is a clean WriteError with the journal kept.
    monkeypatch.setattr("colibri_format.writer.ColibriWriter.check_free_space", lambda writer, extra=0: None)
    with pytest.raises(WriteError, match="No space left|disk full|size limit"):
        convert(small_ckpt, out)
    assert not out.exists()
    assert read_journal(journal_path_for(out)).header is not None
    # 3. With room again, the same job resumes to the same bytes.
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_tmpfs)], check=True)
    monkeypatch.undo()
    convert(small_ckpt, out)
    assert _digest(out) == small_clean[0]


# --- changed input, damaged state -------------------------------------------------------------------
def _crashed_copy(ckpt: Path, tmp_path: Path, n: int) -> tuple[Path, Path]:
    import shutil

    src = tmp_path / "ckpt"
    shutil.copytree(ckpt, src)
    out = tmp_path / "out" / "m.colibri"
    out.parent.mkdir()
    done = subprocess.run(_cli(src, out, "--workers", "1"), env={**ENV, "COLIBRI_CRASH_AT": str(n)},
                          capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL
    return src, out


@pytest.mark.parametrize("change", ["config", "shard-touched", "shard-removed-from-index"])
def test_changed_input_refuses_resume_until_restart(small_ckpt, small_clean, tmp_path, change, capsys):
    src, out = _crashed_copy(small_ckpt, tmp_path, small_clean[1] // 2)
    if change == "config":
        cfg = (src / "config.json").read_text().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-06')
        assert "1e-06" in cfg
        (src / "config.json").write_text(cfg)
    elif change == "shard-touched":
        shard = sorted(src.glob("*.safetensors"))[1]
        os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    else:
        index = src / "model.safetensors.index.json"
        index.write_text(index.read_text().replace('"metadata": {', '"metadata": {"x": 1, '))
    with pytest.raises(ResumeError, match="--restart") as info:
        convert(src, out)
    assert "changed" in str(info.value)
    rc = cli_main(["convert", "--model-path", str(src), "--output-path", str(out)])
    assert rc == 1 and "--restart" in capsys.readouterr().err
    assert not out.exists()
    rc = cli_main(["convert", "--model-path", str(src), "--output-path", str(out), "--restart", "--quiet"])
    assert rc == 0
    assert validate_file(out).valid
    if change == "shard-touched":  # same bytes, so the same file
        assert _digest(out) == small_clean[0]


def test_changed_options_refuse_resume(small_ckpt, small_clean, tmp_path):
    src, out = _crashed_copy(small_ckpt, tmp_path, small_clean[1] // 2)
    with pytest.raises(ResumeError, match="options changed \\(dtype\\)"):
        convert(src, out, dtype="bfloat16")
    convert(src, out, workers=3)  # the worker count is not an option of the output
    assert _digest(out) == small_clean[0]


def test_damaged_part_and_torn_journal_are_redone(small_ckpt, small_clean, tmp_path):
    src, out = _crashed_copy(small_ckpt, tmp_path, small_clean[1] - 1)  # all journaled, not finalized
    state = read_journal(journal_path_for(out))
    experts = [r for r in state.pieces if r["kind"] == "expert"]
    assert experts
    from colibri_format import spec as S
    from colibri_format.convert.adapters import get_adapter
    from colibri_format.convert.source import open_checkpoint
    from colibri_format.writer import ColibriWriter

    with open_checkpoint(src) as ck:
        model = get_adapter("mixtral").normalize_config(ck.config.raw)
    plan = ColibriWriter(tmp_path / "probe.colibri", model, dense_dtype=S.DType.F16,
                         expert_format=S.ExpertFormat.INT8_ROW).plan
    off = plan.blob_offset(experts[0]["layer"], experts[0]["expert"])
    with open(part_path_for(out), "r+b") as fh:  # flip one byte of a journaled blob
        fh.seek(off + 100)
        b = fh.read(1)
        fh.seek(off + 100)
        fh.write(bytes([b[0] ^ 0xFF]))
    with open(journal_path_for(out), "ab") as fh:  # and tear the journal's tail
        fh.write(frame({"kind": "expert", "layer": 0, "expert": 7, "checksum": 1})[:-5])
    summary = convert(src, out)
    assert summary.pieces_resumed == len(state.pieces) - 1
    assert _digest(out) == small_clean[0]


def test_forged_journal_records_are_ignored(small_ckpt, small_clean, tmp_path):
    """Records naming nothing in the plan, or with mistyped fields, are redone rather than trusted."""
    src, out = _crashed_copy(small_ckpt, tmp_path, small_clean[1] - 1)
    good = len(read_journal(journal_path_for(out)).pieces)
    forged = [{"kind": "expert", "layer": 99, "expert": 0, "checksum": 1, "error": None},
              {"kind": "expert", "layer": 0, "expert": 1, "checksum": "1", "error": None},
              {"kind": "expert", "layer": True, "expert": 1, "checksum": 5, "error": None},
              {"kind": "expert", "layer": 1, "expert": 2, "checksum": 5, "error": [float("1e300"), 0.0]},
              {"kind": "dense", "name": "../../etc/passwd", "checksum": 3},
              {"kind": "dense", "name": "embed_tokens", "checksum": 3}]
    with open(journal_path_for(out), "ab") as fh:
        fh.write(b"".join(frame(r) for r in forged))
    summary = convert(src, out)
    assert summary.pieces_resumed == good - 2  # (0, 1) and embed_tokens now carry a wrong checksum
    assert _digest(out) == small_clean[0]


def test_lock_from_killed_writer_is_stale(small_ckpt, small_clean, tmp_path):
    src, out = _crashed_copy(small_ckpt, tmp_path, small_clean[1] // 2)
    assert lock_path_for(out).exists()  # SIGKILL left it behind
    convert(src, out)
    assert _digest(out) == small_clean[0] and _leftovers(out) == []


def test_unreadable_fresh_lock_is_respected(small_ckpt, tmp_path, monkeypatch):
    out = tmp_path / "m.colibri"
    lock_path_for(out).write_text("")
    with pytest.raises(WriteError, match="being created"):
        convert(small_ckpt, out)
    monkeypatch.setattr(journal, "UNREADABLE_LOCK_GRACE_S", -1.0)
    convert(small_ckpt, out)
    assert out.exists()


# --- memory -----------------------------------------------------------------------------------------
def test_peak_memory_stays_near_a_few_chunks(big_ckpt, tmp_path):
    """Streaming keeps RSS far under 2 x the largest source tensor + 256 MB, whatever the checkpoint size."""
    out = tmp_path / "m.colibri"
    code = ("import sys; from colibri_format.cli import main; "
            f"rc = main(['convert', '--model-path', {str(big_ckpt)!r}, '--output-path', {str(out)!r}, '--quiet']); "
            "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]); sys.exit(rc)")
    # VmHWM, not ru_maxrss: after fork+exec ru_maxrss still counts the parent's (this test process's) RSS
    done = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    peak = int(done.stdout.split()[-1]) * 1024
    largest = 4096 * 512 * 2  # the bf16 embedding; experts are 512 x 1024
    source = sum(p.stat().st_size for p in big_ckpt.glob("*.safetensors"))
    assert peak < 2 * largest + (256 << 20), peak
    assert peak < source / 2, (peak, source)


# --- simulated power cuts ---------------------------------------------------------------------------
# kill -9 keeps the page cache, so it cannot lose a write. Here every write and fsync of a clean run is
# logged; a power cut at event k keeps, per file, what was fsynced before k and, of the later writes, each
# one whole, torn or not at all. That disk image must satisfy the journal invariant (every record describes
# bytes that are really in the .part) and must resume to the same file.
_ROLES = (".journal.new", ".journal", ".part")


def _role(fd: int) -> str | None:
    target = os.readlink(f"/proc/self/fd/{fd}")
    return next((r for r in _ROLES if target.endswith(r)), None)


def _record_io(monkeypatch) -> list[tuple]:
    import threading

    from colibri_format import writer

    events: list[tuple] = []
    lock = threading.Lock()

    def log(*event):
        with lock:
            events.append(event)

    real_pwrite, real_append, real_fsync = writer.pwrite_all, journal._write_all, journal.fsync_fd
    real_replace = os.replace

    def pwrite(fd, data, offset):
        log("write", _role(fd), offset, bytes(memoryview(data).cast("B")))
        real_pwrite(fd, data, offset)

    def append(fd, data):
        log("write", _role(fd), os.fstat(fd).st_size, bytes(data))
        real_append(fd, data)

    def fsync(fd):
        log("fsync", _role(fd))
        real_fsync(fd)

    def replace(src, dst):
        log("replace", next((r for r in _ROLES if str(src).endswith(r)), None),
            next((r for r in _ROLES if str(dst).endswith(r)), "final"))
        real_replace(src, dst)

    monkeypatch.setattr(writer, "pwrite_all", pwrite)  # every byte of the .part, finalize's included
    monkeypatch.setattr(journal, "_write_all", append)
    monkeypatch.setattr(journal, "fsync_fd", fsync)
    monkeypatch.setattr(writer, "fsync_fd", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def _put(image: bytearray, offset: int, data: bytes) -> None:
    if len(image) < offset + len(data):
        image.extend(bytes(offset + len(data) - len(image)))
    image[offset:offset + len(data)] = data


def _disk_after_cut(events: list[tuple], k: int, part_size: int, rng: random.Random) -> dict[str, bytearray]:
    durable: dict[str, bytearray] = {".part": bytearray(part_size)}
    pending: dict[str, list] = {}
    for event in events[:k]:
        if event[0] == "write":
            pending.setdefault(event[1], []).append(event[2:])
        elif event[0] == "fsync":
            image = durable.setdefault(event[1], bytearray())
            for offset, data in pending.pop(event[1], []):
                _put(image, offset, data)
        elif event[0] == "replace" and event[2] == ".journal":
            durable[".journal"] = durable.pop(".journal.new", bytearray())
            pending[".journal"] = pending.pop(".journal.new", [])
    for role, writes in pending.items():
        image = durable.setdefault(role, bytearray())
        for offset, data in writes:
            fate = rng.random()
            if fate < 1 / 3:
                continue  # lost
            _put(image, offset, data if fate < 2 / 3 else data[:rng.randrange(len(data) + 1)])
    return durable


def test_simulated_power_cuts(small_ckpt, small_clean, tmp_path, monkeypatch):
    from colibri_format import spec as S
    from colibri_format.convert.verify import record_piece
    from colibri_format.writer import ColibriWriter

    clean_out = tmp_path / "clean" / "m.colibri"
    clean_out.parent.mkdir()
    events = _record_io(monkeypatch)
    convert(small_ckpt, clean_out, workers=2)
    monkeypatch.undo()
    assert _digest(clean_out) == small_clean[0]
    last = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == "final")
    probe = ColibriWriter(tmp_path / "probe.colibri", _small_model(small_ckpt), dense_dtype=S.DType.F16,
                          expert_format=S.ExpertFormat.INT8_ROW)
    probe.abort(remove_part=True)
    rng = random.Random(7)
    fsyncs = [i for i, e in enumerate(events[:last]) if e[0] == "fsync"]
    cuts = sorted({*fsyncs, *(i + 1 for i in fsyncs), *rng.sample(range(1, last), 12), last})
    resumed_any = False
    for k in cuts:
        disk = _disk_after_cut(events, k, probe.plan.metadata_offset, rng)
        records, _ = parse_records(bytes(disk.get(".journal", b"")))
        part = bytes(disk[".part"])
        for r in records[1:]:  # the invariant: a record never describes bytes the disk lost
            slot = probe.slot(record_piece(probe, r))
            piece = part[slot.offset:slot.offset + slot.size]
            assert xxhash.xxh3_64_intdigest(piece, seed=slot.seed) == r["checksum"], (k, r)
        out = tmp_path / f"cut{k}" / "m.colibri"
        out.parent.mkdir()
        for role, image in disk.items():
            out.with_name(f".{out.name}{role}").write_bytes(bytes(image))
        summary = convert(small_ckpt, out)
        resumed_any |= summary.pieces_resumed > 0
        assert _digest(out) == small_clean[0], k
        assert _leftovers(out) == [], k
    assert resumed_any


def _small_model(ckpt: Path) -> dict:
    from colibri_format.convert.adapters import get_adapter
    from colibri_format.convert.source import open_checkpoint

    with open_checkpoint(ckpt) as src:
        return get_adapter(src.config.model_type).normalize_config(src.config.raw)
