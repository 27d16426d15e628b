"""`colibri infer` end to end on a synthetic file (ids in, ids out), and how `--devices` is handed to the
launcher: the parent builds the worker command from the parsed options and exits with the ranks' status."""

import json
import sys

import pytest

from colibri_format.cli import main
from colibri_format.runtime.cache.cachesim import pins_from_trace
from colibri_format.runtime.parallel import launch


def _infer_json(capsys, *args):
    assert main(["infer", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_infer_json_stats_and_trace(model_file, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    result = _infer_json(capsys, model_file, "--ids", "1,2,3", "--max-new-tokens", "6", "--trace", str(trace),
                         "--max-cached-experts", "6")          # paged: 6 slots for 3 layers x 8 experts
    assert len(result["output_ids"]) == 6 and result["prompt_ids"] == [1, 2, 3]
    stats = result["stats"]
    assert stats["experts_touched"] > 0 and stats["cache_misses"] > 0
    assert stats["hit_rate"] == stats["cache_hits"] / (stats["cache_hits"] + stats["cache_misses"])
    assert stats["misses_per_token"] == stats["cache_misses"] / 9          # 3 prompt + 6 generated tokens
    assert stats["paged_gb_per_s"] > 0 and stats["bytes_zero_copy"] == stats["cache_misses"] * 8192
    assert stats["bytes_paged"] % 8192 == 0 and stats["bytes_paged"] <= stats["expert_loads"] * 8192   # or filled
    assert trace.read_text().count("\n") >= 9


def test_infer_human_view_prints_ids_and_stats(model_file, capsys):
    greedy = _infer_json(capsys, model_file, "--ids", "4,5", "--max-new-tokens", "3")
    assert main(["infer", model_file, "--ids", "4,5", "--max-new-tokens", "3", "--stats"]) == 0
    captured = capsys.readouterr()
    assert captured.out.split() == [str(t) for t in greedy["output_ids"]]   # no tokenizer: the ids
    assert "finish_reason" in captured.err and "experts_touched" in captured.err


def test_all_resident_stats_say_every_expert_hit(model_file, capsys):
    stats = _infer_json(capsys, model_file, "--ids", "4,5", "--max-new-tokens", "3")["stats"]
    assert stats["experts_touched"] > 0 and stats["cache_hits"] == stats["cache_misses"] == 0
    assert stats["hit_rate"] == 1.0 and stats["misses_per_token"] == 0.0


def test_static_policy_pins_from_trace(model_file, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    greedy = _infer_json(capsys, model_file, "--ids", "5,6,7", "--max-new-tokens", "5", "--trace", str(trace))
    pins = pins_from_trace(trace, 4)
    assert len(pins) == 4 and len(set(pins)) == 4
    static = _infer_json(capsys, model_file, "--ids", "5,6,7", "--max-new-tokens", "5", "--cache-policy", "static",
                         "--pin-from-trace", str(trace), "--max-cached-experts", "4")
    assert static["output_ids"] == greedy["output_ids"]   # the cache policy never changes the answer


def test_static_without_pins_is_a_clear_error(model_file, tmp_path, capsys):
    assert main(["infer", model_file, "--ids", "1", "--cache-policy", "static"]) == 1
    assert "--pin-from-trace" in capsys.readouterr().err
    trace = tmp_path / "t.jsonl"
    trace.write_text("")
    assert main(["infer", model_file, "--ids", "1", "--pin-from-trace", str(trace)]) == 1
    assert "only applies to --cache-policy static" in capsys.readouterr().err


@pytest.mark.parametrize("ids, needle", [("1,2,x", "comma-separated"), ("1,2,100000", "outside")])
def test_bad_ids_exit_1(model_file, capsys, ids, needle):
    assert main(["infer", model_file, "--ids", ids]) == 1
    assert needle in capsys.readouterr().err


def test_prompt_and_ids_together_exit_1(model_file, capsys):
    assert main(["infer", model_file, "--ids", "1", "--prompt", "hi"]) == 1
    assert "exactly one" in capsys.readouterr().err
    assert main(["infer", model_file, "--ids", "1", "--prompt", "hi", "--json"]) == 1     # the error as JSON
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "InvalidInput" and "exactly one" in error["message"] and error["field"] == "prompt"


# --- --devices ------------------------------------------------------------------------------------------

@pytest.fixture()
def launched(monkeypatch):
    """Stand in for the launcher: record what the CLI asks for, answer with a chosen exit status."""
    monkeypatch.delenv("COLIBRI_EP_WORKER", raising=False)
    calls = []

    def fake_launch(command, devices, device):
        calls.append((list(command), list(devices), device))
        return fake_launch.status

    fake_launch.status = 0
    monkeypatch.setattr(launch, "launch", fake_launch)
    return calls, fake_launch


def test_devices_parent_launches_the_same_command_and_exits_with_its_status(model_file, launched, capsys):
    calls, fake = launched
    fake.status = 3
    args = ["infer", model_file, "--ids", "1,2", "--max-new-tokens", "4", "--temperature", "0.5", "--seed", "7",
            "--devices", "0,1", "--stats"]
    assert main(args) == 3
    assert capsys.readouterr().out == ""                # the parent prints nothing: rank 0 does
    (command, devices, device), = calls
    assert command[:3] == [sys.executable, "-m", "colibri_format"]
    assert devices == [0, 1] and device == "cpu"
    worker = command[3:]
    assert worker[:2] == ["infer", model_file]
    for flag, value in (("--ids", "1,2"), ("--max-new-tokens", "4"), ("--temperature", "0.5"), ("--seed", "7"),
                        ("--devices", "0,1")):
        assert worker[worker.index(flag) + 1] == value
    assert "--stats" in worker and "--json" not in worker and "--chat" not in worker
    assert "--prompt" not in worker                      # unset options keep their defaults in the worker
    fake.status = 0
    assert main(worker) == 0                            # the worker line parses back to the same command line
    assert calls[1][0] == command


def test_devices_parent_checks_the_split_before_launching(model_file, launched, capsys):
    calls, _ = launched
    assert main(["infer", model_file, "--ids", "1", "--devices", "0,1,2,3,4,5,6,7,8"]) == 1
    assert "exceeds the 8 experts" in capsys.readouterr().err
    assert calls == []


def test_one_device_runs_in_process(model_file, launched, capsys):
    calls, _ = launched
    assert _infer_json(capsys, model_file, "--ids", "1,2", "--max-new-tokens", "2", "--devices", "0")["output_ids"]
    assert calls == []


@pytest.mark.parametrize("devices, needle", [("0,x", "comma-separated"), ("1,1", "distinct")])
def test_bad_devices_exit_1(model_file, launched, capsys, devices, needle):
    assert main(["infer", model_file, "--ids", "1", "--devices", devices]) == 1
    assert needle in capsys.readouterr().err


# --- the llama-cli options: --file, --prompt -, --system, --stop, top-k / min-p / repetition penalty -------------

def _tokenizer(path):
    from colibri_format.runtime import Engine

    with Engine(path) as engine:
        return engine.tokenizer


def test_prompt_from_a_file_or_standard_input_equals_the_prompt(chat_file, tmp_path, capsys, monkeypatch):
    import io

    def run(*args):
        result = _infer_json(capsys, chat_file, *args, "--max-new-tokens", "5")
        return result["prompt_ids"], result["output_ids"], result["text"]

    text = "Once upon a time, in a café"
    plain = run("--prompt", text)
    (tmp_path / "p.txt").write_text(text, encoding="utf-8")
    assert run("--file", str(tmp_path / "p.txt")) == plain
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    assert run("--prompt", "-") == plain
    assert plain[0] == _tokenizer(chat_file).encode(text)


def test_the_text_prompt_is_echoed_then_the_streamed_text(chat_file, capsys):
    result = _infer_json(capsys, chat_file, "--prompt", "Hello", "--max-new-tokens", "6")
    assert main(["infer", chat_file, "--prompt", "Hello", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == "Hello" + result["text"] + "\n"


def test_system_prompt_goes_through_the_chat_template(chat_file, capsys):
    result = _infer_json(capsys, chat_file, "--prompt", "hi", "--system", "Be brief.", "--max-new-tokens", "3")
    expected = _tokenizer(chat_file).encode_chat([{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "hi"}])
    assert result["prompt_ids"] == expected
    assert main(["infer", chat_file, "--prompt", "hi", "--system", "Be brief.", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out == result["text"] + "\n"            # a chat prompt is not echoed


def test_stop_strings_end_the_output_before_them(chat_file, capsys):
    full = _infer_json(capsys, chat_file, "--prompt", "Hello", "--max-new-tokens", "24")["text"]
    stop = full[5:8]
    cut = full[:full.find(stop)]
    result = _infer_json(capsys, chat_file, "--prompt", "Hello", "--max-new-tokens", "24", "--stop", "@@never@@",
                         "--stop", stop)
    assert result["text"] == cut and result["finish_reason"] == "stop"
    assert main(["infer", chat_file, "--prompt", "Hello", "--max-new-tokens", "24", "--stop", stop]) == 0
    assert capsys.readouterr().out == "Hello" + cut + "\n"             # the stop string never reaches the screen


def test_sampling_options_reach_the_engine(chat_file, capsys):
    from colibri_format.runtime.infer import run_infer

    greedy = _infer_json(capsys, chat_file, "--prompt", "Hello", "--max-new-tokens", "8")["output_ids"]
    assert _infer_json(capsys, chat_file, "--prompt", "Hello", "--max-new-tokens", "8", "--temperature", "1.3",
                       "--seed", "2", "--top-k", "1")["output_ids"] == greedy
    options = {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.3, "seed": 4}
    direct = run_infer(chat_file, "Hello", max_new_tokens=8, **options)["output_ids"]
    assert _infer_json(capsys, chat_file, "--prompt", "Hello", "--max-new-tokens", "8", "--temp", "0.9",
                       "--top-k", "20", "--top-p", "0.9", "--min-p", "0.05", "--repeat-penalty", "1.3",
                       "--seed", "4")["output_ids"] == direct


def test_options_the_ranks_do_not_take_are_refused_with_several_devices(model_file, launched, capsys):
    calls, _ = launched
    assert main(["infer", model_file, "--ids", "1", "--devices", "0,1", "--top-k", "5", "--stop", "x"]) == 1
    assert "not available with several --devices yet: --top-k, --stop" in capsys.readouterr().err
    assert calls == []


def test_a_prompt_from_standard_input_reaches_the_ranks_as_text(chat_file, launched, capsys, monkeypatch):
    import io

    calls, _ = launched
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello ranks")))
    assert main(["infer", chat_file, "--prompt", "-", "--devices", "0,1"]) == 0
    worker = calls[0][0][3:]
    assert worker[worker.index("--prompt") + 1] == "hello ranks"


@pytest.mark.parametrize("flags, expected", [((), True), (("--float-activations",), False),
                                             (("--int8-activations",), True)])
def test_the_activation_switch_reaches_the_engine(model_file, capsys, monkeypatch, flags, expected):
    """--int8-activations (the default) / --float-activations become EngineConfig.int8_activations."""
    from colibri_format.runtime import infer as infer_lib

    seen = {}
    real = infer_lib.run_infer

    def spy(*args, **kw):
        seen.update(kw)
        return real(*args, **kw)

    monkeypatch.setattr(infer_lib, "run_infer", spy)
    _infer_json(capsys, model_file, "--ids", "1,2", "--max-new-tokens", "2", *flags)
    assert seen["int8_activations"] is expected


def test_chat_takes_the_activation_switch(chat_file, capsys, monkeypatch):
    import io

    import colibri_format.runtime as runtime

    configs = []

    class Recorded(runtime.EngineConfig):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            configs.append(self)

    monkeypatch.setattr(runtime, "EngineConfig", Recorded)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"/exit\n")))
    assert main(["chat", chat_file, "--float-activations"]) == 0
    assert [c.int8_activations for c in configs] == [False]


def test_kv_cache_dtype_option(model_file, capsys):
    result = _infer_json(capsys, model_file, "--ids", "1,2,3", "--max-new-tokens", "4", "--kv-cache-dtype",
                         "bfloat16")
    assert len(result["output_ids"]) == 4


@pytest.mark.parametrize("option, value", [("--kv-cache-dtype", "float8"), ("--cache-policy", "belady"),
                                           ("--cache-policy", "bogus"), ("--cache-scope", "layer")])
def test_an_engine_choice_the_engine_does_not_take_is_a_usage_error(model_file, capsys, option, value):
    """Checked while the command line is parsed (exit 2, the option named), not once the engine is open: a cache
    option of an all-resident run was accepted whatever it said."""
    assert main(["infer", model_file, "--ids", "1", option, value]) == 2
    assert option in capsys.readouterr().err
