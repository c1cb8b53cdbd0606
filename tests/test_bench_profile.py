"""The step profile: wall-time shares of concurrent ops, HLO joins, and a traced tiny step."""

import json

import pytest

from longt5_jax.bench import profile


def test_concurrent_ops_share_wall_time_and_gaps_are_idle():
    events = [
        {"name": "a", "ts": 0.0, "dur": 10.0},
        {"name": "b", "ts": 5.0, "dur": 10.0},  # overlaps a for 5 us
        {"name": "c", "ts": 20.0, "dur": 4.0},  # after a 5 us gap
    ]
    share, idle, span = profile.wall_shares(events)
    assert share == {0: 7.5, 1: 7.5, 2: 4.0}
    assert idle == 5.0 and span == 24.0
    assert sum(share.values()) + idle == span


ENC = "jit(train_step)/LongT5.encode/encoder/while/body/closed_call/EncoderLayer/mlp/mul"
DEC = "jit(train_step)/LongT5.decode/decoder/while/body/layers/self_attention/query/dot_general"
HLO = "\n".join(
    [
        "%fused_computation.1 (p: f32[4,8]) -> f32[4,4] {",
        "  %p = f32[4,8]{1,0} parameter(0)",
        "  ROOT %d = f32[4,4]{1,0} dot(%p, %p), lhs_contracting_dims={1}, "
        + "rhs_contracting_dims={1}",
        "}",
        "",
        "ENTRY %main (x: f32[4,8]) -> f32[4,4] {",
        "  %x = f32[4,8]{1,0} parameter(0)",
        "  %loop_fusion.3 = f32[4,8]{1,0} fusion(%x), kind=kLoop, calls=%fused_computation.2, "
        + f'metadata={{op_name="{ENC}"}}',
        "  ROOT %gemm_fusion.1 = f32[4,4]{1,0} fusion(%loop_fusion.3), kind=kOutput, "
        + f'calls=%fused_computation.1, metadata={{op_name="{DEC}"}}',
        "}",
    ]
)


def test_ops_are_named_by_model_path_and_kind():
    ops = profile.hlo_ops(HLO)
    assert ops["gemm_fusion.1"]["matmul"] and not ops["loop_fusion.3"]["matmul"]
    assert ops["gemm_fusion.1"]["shape"] == "f32[4,4]{1,0}"
    trace = {
        "traceEvents": [
            {"ph": "X", "name": "loop_fusion.3", "ts": 0.0, "dur": 3000.0},
            {"ph": "X", "name": "gemm_fusion.1", "ts": 3000.0, "dur": 1000.0},
            {"ph": "X", "name": "ThunkExecutor::Execute", "ts": 0.0, "dur": 4000.0},
        ]
    }
    b = profile.breakdown(trace, HLO, top=5)
    assert b["groups"] == [
        {"group": "encoder mlp other", "ms": 3.0},
        {"group": "decoder self_attention matmul", "ms": 1.0},
    ]
    assert [r["op"] for r in b["top_ops"]] == ["loop_fusion.3", "gemm_fusion.1"]


def test_the_devices_kernels_are_read_by_name_with_their_launch():
    """A GPU trace as jax 0.11 writes it (the step's kernels inside CUDA graphs, so their
    `hlo_op` names the graph, not the op): kernels by name over the device's timeline only,
    per run, a Pallas kernel's declared FLOPs dropped, registers, shared memory, occupancy."""
    details = "regs:209 static_shared:0 dynamic_shared:139776 grid:2,12,128 occ_pct:12.5"
    fwd = "encoder_attention_fwd_flops_141733920768"
    gpu = {"ph": "X", "pid": 1, "args": {"hlo_op": "command_buffer_1"}}
    trace = {
        "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/host:CPU"}},
            {**gpu, "name": fwd, "ts": 0.0, "dur": 1500.0, "args": {"kernel_details": details}},
            {**gpu, "name": fwd, "ts": 2000.0, "dur": 1300.0, "args": {"kernel_details": details}},
            {**gpu, "name": "loop_add_fusion", "ts": 4000.0, "dur": 200.0},
            {"ph": "X", "pid": 7, "name": "ThunkExecutor::Execute", "ts": 0.0, "dur": 9000.0},
        ]
    }
    rows = profile.device_kernels(trace, runs=2)
    assert [r["kernel"] for r in rows] == ["encoder_attention_fwd", "loop_add_fusion"]
    assert rows[0] == {
        "kernel": "encoder_attention_fwd", "kind": "pallas", "ms": 1.4, "calls": 1.0,
        "regs": 209, "shared": 139776, "occupancy": 12.5,
    }  # fmt: skip
    assert rows[1] == {"kernel": "loop_add_fusion", "kind": "other", "ms": 0.1, "calls": 0.5}
    assert profile.by_kind(rows) == {"pallas": 1.4, "matmul": 0.0, "other": 0.1}


@pytest.mark.parametrize(
    "kernel, kind",
    [
        ("encoder_attention_dside", "pallas"),
        ("encoder_local_attention_fwd", "pallas"),
        ("decoder_attention_dkv", "pallas"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", "matmul"),  # cuBLAS on an H100
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
        ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn", "matmul"),
        ("gemm_fusion_dot_142", "matmul"),  # XLA's Triton GEMM
        ("loop_multiply_fusion_9", "other"),
        ("input_reduce_fusion_24", "other"),
        ("encoder_attention_fwd_like_but_not", "other"),  # not one of kernels.launch.KERNELS
    ],
)
def test_a_devices_kernel_is_sorted_into_the_roofline_s_kinds(kernel, kind):
    assert profile.kind_of(kernel) == kind


@pytest.mark.slow
def test_a_traced_tiny_step_is_broken_down(tmp_path):
    argv = ["--preset", "tiny", "--input_length", "64", "--target_length", "8"]
    assert profile.main([*argv, "--out_dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "profile.json").read_text())
    b = report["breakdown"]
    groups = {r["group"] for r in b["groups"]}
    assert any(g.startswith("encoder attention") for g in groups), groups
    assert any(g.startswith("decoder") for g in groups), groups
    busy = sum(r["ms"] for r in b["groups"])
    assert abs(busy + b["idle_ms"] - b["span_ms"]) < 1e-6 * b["span_ms"] + 1e-3
