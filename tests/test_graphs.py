"""CUDA-graph modes and the vLLM V1 overhead terms (kvsim.cost.graphs, kvsim.cost.engine_terms):
capture sizes as vLLM 0.33.0 chooses them, each step's mode and padded size, and what a
kvsim-overhead/3 file changes in a step's price. Expected values are worked out by hand."""

import json

import numpy as np

import pytest

from kvsim.cost.engine_terms import ApiServer, GraphTerms
from kvsim.cost.graphs import CudaGraphs, capture_sizes
from kvsim.cost.model import Profiled, StepBatch
from kvsim.cost.overhead import NONE, Overhead, load_overhead
from kvsim.config.errors import InputError
from kvsim.model.specs import GPU_PRESETS, MODEL_PRESETS, KVSpec


def test_capture_sizes_follow_vllm():
    # max_num_seqs 128: ceiling min(256, 512) = 256: 1, 2, 4, 8..248 by 8, then 256
    assert capture_sizes(128, 2048) == (1, 2, 4, *range(8, 256, 8), 256)
    # V1's large-GPU defaults: ceiling 512, multiples of 16 from 256
    big = capture_sizes(1024, 8192)
    assert big[-3:] == (480, 496, 512) and 264 not in big and 272 in big
    # few sequences: ceiling 16
    assert capture_sizes(8, 2048) == (1, 2, 4, 8, 16)
    # a small token budget caps the ceiling and is itself captured; max_num_seqs (128) is not
    assert capture_sizes(128, 100) == (1, 2, 4, *range(8, 100, 8), 100)
    # max_num_seqs off the 8-grid is captured for uniform decode batches
    assert 100 in capture_sizes(100, 2048) and capture_sizes(100, 2048)[-1] == 200


def test_steps_pad_to_the_next_size_and_take_their_mode():
    g = CudaGraphs.vllm(128, 2048)
    assert [g.padded(n) for n in (1, 3, 9, 248, 249, 256, 257)] == [1, 4, 16, 248, 256, 256, None]
    assert g.mode(9, 9) == "full"  # nine decodes
    assert g.mode(24, 10) == "piecewise"  # nine decodes and a 15-token chunk
    assert g.mode(600, 1) == "eager"  # a whole 600-token prompt


def profiled(overhead, limits=(128, 2048)):
    m = MODEL_PRESETS["llama-2-7b"]
    return Profiled(m, GPU_PRESETS["h100-80gb"], KVSpec(m, "fp16"), 1, block_size=16, overhead=overhead, limits=limits)


def test_graph_steps_run_padded_and_launch_by_mode():
    plain = profiled(NONE)
    graphs = Overhead(
        "overhead:g",
        step_s=1e-4,
        graphs=GraphTerms(piecewise_per_layer_s=20e-6),
        launch_per_layer_s=1e-3,
        kernels=(("attention_decode", 0.5),),
    )
    g = profiled(graphs)
    decode = StepBatch.build([], [700] * 9)
    a, b = plain.breakdown(decode), g.breakdown(decode)
    # linear ops and the embedding at the 16-token graph; attention at half the profile's;
    # a full graph launches nothing per layer; the host's step part as given
    assert b["linear"] == pytest.approx(plain.breakdown(StepBatch.build([], [700] * 16))["linear"])
    assert b["attention_decode"] == pytest.approx(a["attention_decode"] / 2)
    assert b["lm_head"] == a["lm_head"] and b["overhead_launch"] == 0 and b["overhead_step"] == 1e-4
    mixed = g.breakdown(StepBatch.build([(15, 576)], [700] * 9))
    assert mixed["overhead_launch"] == pytest.approx(32 * 20e-6)  # 32 layers, piecewise
    eager = g.breakdown(StepBatch.build([(600, 0)], []))
    device = sum(v for k, v in eager.items() if not k.startswith("overhead"))
    assert eager["overhead_launch"] == pytest.approx(max(0.0, 32e-3 - device))


def test_api_server_delay():
    api = ApiServer(request_s=5e-3, per_prompt_token_s=2e-6)
    assert api.delay(500) == pytest.approx(6e-3)
    assert ApiServer.from_doc(api.to_doc()) == api


def write(tmp_path, **parts):
    doc = {
        "format": "kvsim-overhead/3",
        "name": "mine",
        "gpu": "h100-80gb",
        "host": {"step_ms": 0.1, "per_seq_ms": 0.002, "per_prefill_token_ms": 0.0, "launch_per_layer_ms": 0.05},
        "graphs": {"rule": "vllm-0.33.0", "piecewise_per_layer_ms": 0.01},
        "kernels": {"attention_decode": 0.8},
        "api": {"request_ms": 6, "per_prompt_token_us": 1},
    }
    doc.update(parts)
    path = tmp_path / "o.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_graph_overhead_file_reads_back(tmp_path):
    o = load_overhead(str(write(tmp_path)))
    assert o.graphs == GraphTerms("vllm-0.33.0", 1e-5) and o.kernels == (("attention_decode", 0.8),)
    assert o.api == ApiServer(6e-3, 1e-6) and o.launch_per_layer_s == 5e-5 and o.label == "overhead:mine"
    assert o.linear == "measured" and load_overhead(str(write(tmp_path, linear="envelope"))).linear == "envelope"


@pytest.mark.parametrize(
    "part, words",
    [
        ({"graphs": {"rule": "sglang"}}, "graphs.rule"),
        ({"kernels": {"attention": 0.8}}, "unknown part 'attention'"),
        ({"kernels": {"linear": 0}}, "kernels.linear must be > 0"),
        ({"api": {"request_ms": -1}}, "request_ms must be a number >= 0"),
        ({"linear": "smooth"}, "linear must be one of measured, envelope"),
    ],
)
def test_a_bad_graph_overhead_file_is_an_input_error(tmp_path, part, words):
    with pytest.raises(InputError) as info:
        load_overhead(str(write(tmp_path, **part)))
    assert words in str(info.value)


def test_the_api_server_delays_what_the_client_sees():
    import pandas as pd

    table = pd.DataFrame(
        {
            "arrival_s": [0.0, 0.0, 0.0],
            "first_token_s": [1.0, 1.0, 1.0],
            "finish_s": [2.0, 3.0, 3.2],
            "prompt_tokens": [100, 100, 100],
            "outcome": ["completed", "completed", "timed out"],
        }
    )
    seen = ApiServer(request_s=0.5).respond(table, timeout_s=3.2)
    assert seen.first_token_s.tolist() == [1.5, 1.5, 1.5]
    # the second one's last token now comes at 3.5, after its client left at 3.2
    assert seen.finish_s.tolist() == [2.5, 3.2, 3.2]
    assert seen.outcome.tolist() == ["completed", "timed out", "timed out"]
    assert table.finish_s.tolist() == [2.0, 3.0, 3.2]  # the engine's times are left as they were


def test_kvsim_run_adds_the_api_servers_delay(tmp_path):
    from pathlib import Path
    from kvsim.config.scenario import ProfileCost, load_scenario
    from kvsim.analysis.results import run_scenario

    scn, base = load_scenario(Path(__file__).parent / "data" / "golden_tiny.yaml")
    scn = scn.model_copy(update={"policies": scn.policies[3:4]})

    def ttft(request_ms):
        path = write(tmp_path, api={"request_ms": request_ms, "per_prompt_token_us": 0})
        table = run_scenario(scn.model_copy(update={"cost_model": ProfileCost(overhead=str(path))}), base).requests
        done = table[table.outcome == "completed"]
        return (done.first_token_s - done.arrival_s).to_numpy(), (done.finish_s - done.first_token_s).to_numpy()

    (a, span_a), (b, span_b) = ttft(0), ttft(6)
    assert b - a == pytest.approx(np.full(len(a), 6e-3), abs=1e-12)
    assert span_a == pytest.approx(span_b, abs=1e-12)
