import argparse
import json
import shutil

import pytest

from longt5_jax.bench import sass
from longt5_jax.bench.device import launch_text, parse_launch
from longt5_jax.estimate import targets
from longt5_jax.kernels import backend as base

LISTING = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_3:
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0020*/                   MUFU.EX2 R3, R3 ;
        /*0030*/               @P0 FADD R4, R4, R3 ;
        /*0040*/                   LDG.E R5, desc[UR26][R6.64] ;
        /*0050*/                   IMAD R7, R7, 0x4, RZ ;
        /*0058*/                   STL.64 [R1+0x10], R4 ;
        /*0060*/               @P1 BRA `(.L_x_3) ;
        /*0070*/                   BRA `(.L_x_4) ;
.L_x_4:
        /*0080*/                   EXIT ;
"""


def test_read_sass_counts_each_loop_body_by_class():
    """A loop is the code from a backward branch's target to the branch (a forward branch is
    none); predicated instructions count by their opcode; a spilled register's store is local."""
    reading = sass.read_sass(LISTING)
    assert reading["instructions"] == 10
    [loop] = reading["loops"]
    assert loop["instructions"] == 7
    assert loop["by_class"] == {
        "tensor": 1, "exp": 1, "float": 1, "memory": 1, "local": 1, "other": 2
    }  # fmt: skip
    assert loop["opcodes"]["BRA"] == 1


THUNKS = """
025: kCustomKernel [prev=024 (1)  | next=026 (1) ] encoder_attention_fwd_flops_135291469824 \
grid: [2, 12, 256] threads: [128, 1, 1]  shared_memory: 72192 bytes
026: kCustomKernel [prev=025 (1)  | next=027 (1) ] loop_add_fusion grid: [16, 1, 1] \
threads: [128, 1, 1]  shared_memory: 0 bytes
045: kCustomKernel [prev=041 (4)  | next=046 (1) ] encoder_attention_dside_flops_219043332096 \
grid: [2, 12, 16] threads: [256, 1, 1]  shared_memory: 148096 bytes
"""  # a backslash ends each line where XLA writes one line


def test_each_kernels_launch_and_what_it_leaves_of_an_sm():
    """Threads and shared memory from XLA's thunk sequence; programs an SM as CUDA allocates
    (registers in units of 256 a warp, 1 KiB of shared memory a program kept): on an H100, 180
    registers x 128 threads hold 2 programs (3 would need 70,656 registers of 65,536), 168 x 128
    hold 3; 144.6 KiB of shared memory one."""
    launches = sass.read_launches(THUNKS)
    assert launches == {
        ("encoder_attention_fwd", 135291469824): {
            "programs": 6144, "threads": 128, "shared_bytes": 72192
        },
        ("encoder_attention_dside", 219043332096): {
            "programs": 384, "threads": 256, "shared_bytes": 148096
        },
    }  # fmt: skip
    h100 = targets.load("h100-80gb").spec
    fwd = sass.occupancy(
        {"registers": 180, **launches[("encoder_attention_fwd", 135291469824)]}, h100
    )
    assert fwd["programs_per_sm"] == 2 and fwd["limited_by"] == "registers"
    assert fwd["occupancy"] == 8 / 64 and fwd["waves"] == 6144 / (2 * 132)
    assert sass.occupancy({"registers": 168, "threads": 128, "shared_bytes": 0}
                          | {"programs": 1}, h100)["programs_per_sm"] == 3  # fmt: skip
    side = {"registers": 64, **launches[("encoder_attention_dside", 219043332096)]}
    assert sass.occupancy(side, h100)["limited_by"] == "shared memory"
    assert sass.occupancy(side, h100)["programs_per_sm"] == 1
    a100 = targets.load("a100-80gb").spec  # 164 KiB of shared memory an SM
    assert sass.occupancy({**side, "shared_bytes": 90000}, a100)["programs_per_sm"] == 1


def test_launch_settings_parse_with_a_split_and_keys_and_print_back():
    text = "encoder_attention_fwd=4:3:2,encoder_attention_dkv=8:2:1:32,*=8:2"
    want = (("encoder_attention_fwd", 4, 3, 2), ("encoder_attention_dkv", 8, 2, 1, 32), ("*", 8, 2))
    assert parse_launch(text) == want
    assert launch_text(parse_launch(text)) == text
    for bad in ("encoder_*=4:3:3", "*=3:2", "*=8", "*=8:2:1:1", "*=8:2:1:48", "*=8:2:1:32:2"):
        with pytest.raises(argparse.ArgumentTypeError, match="PATTERN=WARPS:STAGES"):
            parse_launch(bad)


def test_bench_sass_names_what_it_lacks_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sass.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("PATH", "")
    assert sass.main(["--cases", "base:tglobal:1024:1:padded"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "ptxas: not found" in err
    assert sass.main(["--cases", "base:nope:1024:1:padded"]) == 2
    assert "--cases 'base:nope:1024:1:padded'" in capsys.readouterr().err


@pytest.mark.slow  # a deviceless compile, ptxas and nvdisasm: 85 s here
def test_bench_sass_reads_every_kernel_and_float32_spills_its_loops_on_an_a100(tmp_path, capsys):
    """ptxas and nvdisasm (the gpu extra's) on a base TGlobal layer compiled for an A100 in
    float32: every encoder kernel read, with registers, and the side gradient's loop over the
    query blocks with its matmuls and exponentials. (Base, not tiny: jax 0.12's Triton crashes
    compiling the tiny model's blocks of 4 tokens; base's 128 compile as fast.)

    And why `attention_kernel="auto"` takes XLA's attention for float32 on compute capability
    8.x (`kernels.backend.suits`): ptxas gives the A100's float32 dq 32 registers, and its loop
    over the side keys loads and stores spilled registers (bfloat16's on the A100 and float32's
    on an H100 keep their loops in registers: `bench sass`, docs/journal.md). If a ptxas stops
    spilling, this fails: revisit `suits`."""
    if shutil.which("nvdisasm") is None:
        pytest.skip("nvdisasm is not on PATH (.ci/run installs it beside the environment)")
    case = "base:tglobal:4096:1:padded"  # 4 chunks of side keys: a loop (1024 tokens: one)
    argv = ["--cases", case, "--target", "a100-80gb", "--dtype", "float32"]
    assert sass.main([*argv, "--out_dir", str(tmp_path)]) == 0
    readings = json.loads((tmp_path / "sass.json").read_text())["cases"][case]
    names = {f"encoder_attention_{k}" for k in ("fwd", "dq", "dkv", "dbias", "dside")}
    assert set(readings) == names
    assert all(0 < r["registers"] <= 255 and r["instructions"] > 0 for r in readings.values())
    assert all(r["threads"] == 256 and r["programs_per_sm"] >= 1 for r in readings.values())
    [blocks] = readings["encoder_attention_dside"]["loops"]
    assert blocks["by_class"]["tensor"] >= 4 and blocks["by_class"]["exp"] >= 1
    assert "encoder_attention_fwd" in capsys.readouterr().out
    dq = readings["encoder_attention_dq"]
    [loop] = dq["loops"]
    local = loop["by_class"].get("local", 0)
    assert dq["registers"] <= 32 and local >= 100, (dq["registers"], local)
    assert not base.suits("8.0", "float32") and base.suits("8.0", "bfloat16")
    assert base.suits("9.0", "float32") and base.suits("8.6", "float16")
    assert not base.suits("7.0", "float16") and not base.suits("", "bfloat16")
