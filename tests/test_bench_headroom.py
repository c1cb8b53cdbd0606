import jax
import jax.numpy as jnp
import pytest

from longt5_jax.bench import headroom
from longt5_jax.estimate import targets


def test_the_plain_attention_does_the_cases_matmuls():
    """Base TGlobal 16k x 2: 3 x 128 local and 1,024 side keys a query, 32,768 queries; as 23
    rows of 1,408 tokens, 1.2% fewer FLOPs. xl Local 4k: 384 keys, 11 rows, 3.1% more."""
    base = headroom.problem("base:tglobal:16384:2")
    assert (base["keys"], base["rows"], base["heads"], base["head_dim"]) == (1408, 23, 12, 64)
    assert base["ours_gflop"] == pytest.approx(4 * 2 * 16384 * 1408 * 12 * 64 / 1e9)
    assert base["gflop"] / base["ours_gflop"] == pytest.approx(23 * 1408 / 32768)
    xl = headroom.problem("xl:local:4096:1")
    assert (xl["keys"], xl["rows"], xl["heads"]) == (384, 11, 32)
    assert abs(xl["gflop"] / xl["ours_gflop"] - 1) < 0.04


def test_the_triton_reference_is_plain_attention_and_its_gradient():
    """As timed (no scale, no segments), interpreted: softmax(q k^T) v and its vjp."""
    (dtype, attend), *_ = headroom.references(interpret=True).values()
    q, k, v, do = (jax.random.normal(jax.random.key(i), (1, 256, 2, 64), dtype) for i in range(4))

    def plain(q, k, v):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    forward, both = headroom._programs(attend)
    assert jnp.abs(forward(q, k, v) - plain(q, k, v)).max() < 1e-5  # measured 1.7e-6
    for got, want in zip(both(q, k, v, do), jax.vjp(plain, q, k, v)[1](do), strict=True):
        assert jnp.abs(got - want).max() < 2e-5 * jnp.abs(want).max()  # measured <= 5.6e-6


@pytest.mark.skipif(not targets.have_gpu_compiler(), reason="the gpu extra is not installed")
def test_both_references_compile_for_an_h100_without_one():
    """Before a lease spends device time on them (~2 s): Triton's kernels and Mosaic GPU's."""
    assert headroom.compiled("base:tglobal:16384:2", "h100-80gb") == {
        "triton": ["__gpu$xla.gpu.triton"],
        "mosaic": ["mosaic_gpu_v2"],
    }


def test_bad_cases_and_a_machine_without_a_gpu_get_one_line(tmp_path, capsys):
    assert headroom.main(["--cases", "base:decoder:4096:2", "--out_dir", str(tmp_path)]) == 2
    assert "expected MODEL:tglobal|local:LENGTH:BATCH" in capsys.readouterr().err
    assert headroom.main(["--cases", "huge:local:4096:2", "--out_dir", str(tmp_path)]) == 2
    assert "unknown LongT5 preset 'huge'" in capsys.readouterr().err
    assert headroom.main(["--out_dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"error: {headroom.NO_GPU}"
    assert not (tmp_path / "headroom.json").exists()
