"""`colibri serve`'s scheduler over a Qwen3-Next file: slots that join and leave keep their Gated DeltaNet states
apart (the runner mode feeds idle slots another slot's token, which restarts only their states)."""

from __future__ import annotations

import pytest

from colibri_format.runtime import Engine, EngineConfig
from colibri_format.serve.scheduler import Scheduler
from tests.hf_hybrid import build, convert_file
from tests.runtime.hf_tiny import prompts
from tests.serve.test_scheduler import submit


@pytest.fixture(scope="module")
def hybrid_file(tmp_path_factory):
    return str(convert_file(build("qwen3_next"), tmp_path_factory.mktemp("q3n")))


@pytest.mark.parametrize("decode", ["packed", "runner"])
def test_shared_slots_give_each_request_its_output_alone(hybrid_file, decode):
    batch = prompts(96, [9, 3, 14, 5, 7, 11], seed=1)
    with Engine(hybrid_file) as engine:
        alone = [engine.generate(p, max_new_tokens=6 + i, stop_ids=[]).output_ids for i, p in enumerate(batch)]
    with Scheduler(hybrid_file, EngineConfig(max_batch_size=3, max_seq_len=64), decode=decode, max_queue=16) as sched:
        jobs = [submit(sched, p, max_tokens=6 + i) for i, p in enumerate(batch)]
        for _, sink in jobs:
            sink.result()
    assert [sink.token_ids() for _, sink in jobs] == alone
