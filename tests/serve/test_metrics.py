"""/metrics: the Prometheus text is well formed (HELP and TYPE before every family, one number per sample), the
time-to-first-token histogram is cumulative, the decode steps are counted by the rows (bucket) they ran and by graph
replay or not, and the expert figures come from the engine's stats snapshots."""

from __future__ import annotations

import re

from colibri_format.serve.metrics import TTFT_BUCKETS, Metrics

SAMPLE = re.compile(r'^(colibri_[a-z_]+)(\{[a-z_]+="[^"]*"\})? (-?[0-9.e+-]+)$')


def parse(text: str) -> dict[str, float]:
    samples, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
            continue
        if line.startswith("# HELP "):
            continue
        m = SAMPLE.match(line)
        assert m, line
        family = re.sub(r"_(bucket|sum|count)$", "", m.group(1))
        assert m.group(1) in typed or family in typed, line
        samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return samples


def test_render_and_figures():
    m = Metrics(max_batch_size=4, max_queue=8)
    m.queue_depth, m.running = 2, 3
    m.count("finished", 5)
    m.prefill(prompt_tokens=40, first_tokens=2, seconds=0.5)
    for _ in range(10):
        m.decode_step(rows=3, seconds=0.01)
    for seconds in (0.02, 0.3, 7.0):
        m.first_token(seconds)
    m.engine_stats({"resident": False, "paging": {"hits": 0, "misses": 0, "bytes_paged": 0}}, now=10.0)
    m.engine_stats({"resident": False, "paging": {"hits": 30, "misses": 10, "bytes_paged": 2_000_000_000,
                                                  "bytes_zero_copy": 1_000_000_000}}, now=12.0)
    s = parse(m.render())
    assert s["colibri_queue_depth"] == 2 and s["colibri_running_requests"] == 3 and s["colibri_max_batch_size"] == 4
    assert s['colibri_requests_total{outcome="finished"}'] == 5
    assert s["colibri_prompt_tokens_total"] == 40 and s["colibri_generation_tokens_total"] == 32
    assert s["colibri_generation_tokens_per_second"] == 3.2            # 32 tokens over the 10 s window
    assert s["colibri_decode_rows_total"] / s["colibri_decode_steps_total"] == 3
    buckets = [s[f'colibri_time_to_first_token_seconds_bucket{{le="{b:g}"}}'] for b in TTFT_BUCKETS]
    assert buckets == sorted(buckets) and buckets[0] == 1 and buckets[-2] == 3
    assert s['colibri_time_to_first_token_seconds_bucket{le="+Inf"}'] == 3
    assert s["colibri_time_to_first_token_seconds_count"] == 3
    assert s["colibri_expert_cache_hit_rate"] == 0.75 and s["colibri_experts_resident"] == 0
    assert s["colibri_expert_paging_gb_per_second"] == 1.5              # 3 GB in 2 s
    assert s["colibri_expert_bytes_paged_total"] == 3e9


def test_decode_buckets_and_graphs():
    m = Metrics(max_batch_size=8)
    m.decode_mode = "runner"
    m.decode_graphs = {1: "captured", 2: "unused", 4: "captured", 8: "batch 8 > 4 uses cuBLAS"}
    m.decode_step(rows=1, seconds=0.01, batch=1, graph=False)       # a bucket's first step runs eagerly
    for _ in range(3):
        m.decode_step(rows=1, seconds=0.01, batch=1, graph=True)
    m.decode_step(rows=3, seconds=0.01, batch=4, graph=True)
    m.decode_step(rows=5, seconds=0.01, batch=8, graph=False)
    m.decode_step(rows=2, seconds=0.01)                             # packed: the rows it ran are the running ones
    m.slot_moves(2)
    s = parse(m.render())
    assert {b: s[f'colibri_decode_batch_steps_total{{batch="{b}"}}'] for b in (1, 2, 4, 8)} == {1: 4, 2: 1, 4: 1, 8: 1}
    assert s['colibri_decode_steps_by_form_total{form="graph"}'] == 4
    assert s['colibri_decode_steps_by_form_total{form="eager"}'] == 3
    assert [s[f'colibri_decode_graph_captured{{batch="{b}"}}'] for b in (1, 2, 4, 8)] == [1, 0, 1, 0]
    assert s['colibri_decode_mode{mode="runner"}'] == 1 and s['colibri_decode_mode{mode="packed"}'] == 0
    assert s["colibri_slot_moves_total"] == 2 and s["colibri_decode_rows_total"] == 14
    snap = m.snapshot()
    assert snap["decode_batches"] == {1: 4, 2: 1, 4: 1, 8: 1} and snap["decode_graphs"][8].startswith("batch 8")


def test_resident_experts_hit_rate_is_one():
    m = Metrics()
    m.engine_stats({"resident": True, "paging": {"hits": 0, "misses": 0}}, now=1.0)
    assert parse(m.render())["colibri_expert_cache_hit_rate"] == 1.0
