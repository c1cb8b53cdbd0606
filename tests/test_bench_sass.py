import json
import shutil

import pytest

from longt5_jax.bench import sass

LISTING = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_3:
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0020*/                   MUFU.EX2 R3, R3 ;
        /*0030*/               @P0 FADD R4, R4, R3 ;
        /*0040*/                   LDG.E R5, desc[UR26][R6.64] ;
        /*0050*/                   IMAD R7, R7, 0x4, RZ ;
        /*0060*/               @P1 BRA `(.L_x_3) ;
        /*0070*/                   BRA `(.L_x_4) ;
.L_x_4:
        /*0080*/                   EXIT ;
"""


def test_read_sass_counts_each_loop_body_by_class():
    """A loop is the code from a backward branch's target to the branch (a forward branch is
    none); predicated instructions count by their opcode."""
    reading = sass.read_sass(LISTING)
    assert reading["instructions"] == 9
    [loop] = reading["loops"]
    assert loop["instructions"] == 6
    assert loop["by_class"] == {
        "tensor": 1, "exp": 1, "float": 1, "memory": 1, "other": 2
    }  # fmt: skip
    assert loop["opcodes"]["BRA"] == 1


def test_bench_sass_names_what_it_lacks_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sass.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("PATH", "")
    assert sass.main(["--cases", "base:tglobal:1024:1:padded"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "ptxas: not found" in err
    assert sass.main(["--cases", "base:nope:1024:1:padded"]) == 2
    assert "--cases 'base:nope:1024:1:padded'" in capsys.readouterr().err


@pytest.mark.slow  # a deviceless compile and the CUDA tools, ~15 s
def test_bench_sass_reads_every_kernel_of_a_compiled_layer(tmp_path, capsys):
    """ptxas and nvdisasm (the gpu extra's) on a tiny TGlobal layer compiled for an H100: every
    encoder kernel read, with registers, and the side gradient's loop over the query blocks
    with its matmuls and exponentials."""
    if shutil.which("nvdisasm") is None:
        pytest.skip("nvdisasm is not on PATH (.ci/run installs it beside the environment)")
    assert sass.main(["--cases", "tiny:tglobal:256:1:packed", "--out_dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "sass.json").read_text())
    readings = report["cases"]["tiny:tglobal:256:1:packed"]
    names = {f"encoder_attention_{k}" for k in ("fwd", "dq", "dkv", "dbias", "dside")}
    assert set(readings) == names
    assert all(0 < r["registers"] <= 255 and r["instructions"] > 0 for r in readings.values())
    [blocks] = readings["encoder_attention_dside"]["loops"]
    assert blocks["by_class"]["tensor"] >= 4 and blocks["by_class"]["exp"] >= 1
    assert "encoder_attention_fwd" in capsys.readouterr().out
