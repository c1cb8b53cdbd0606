"""The documentation's plain-orbax reader (docs/checkpoints.md), run as a user would: in a
fresh process with nothing of longt5_jax imported, on a checkpoint of a real 8-device run."""

import re
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
from helpers import TINY_RUN, child_env

from longt5_jax import train
from longt5_jax.formats.native import model_config, restore_params, saved_tokenizer
from longt5_jax.model import LongT5, abstract_params

DOC = Path(__file__).resolve().parents[1] / "docs" / "checkpoints.md"


def _snippet() -> str:
    section = DOC.read_text().split("## Reading a checkpoint with plain orbax", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_documented_plain_orbax_reader_reads_a_run(tmp_path):
    run = tmp_path / "run"
    argv = [*TINY_RUN, "--gin.RunConfig.train_steps=2", f"--gin.MODEL_DIR='{run}'"]
    assert train.main(argv) == 0
    code = _snippet().replace("/path/to/MODEL_DIR", str(run))
    assert code != _snippet(), "the snippet no longer names /path/to/MODEL_DIR"
    check = f"""{code}
import sys
import numpy as np
assert not [m for m in sys.modules if m.startswith("longt5_jax")]
assert step == 2 and position["batch_size"] == 8 and "ParallelConfig" in gin_text
assert model_fields["vocab_size"] == 2176
np.savez({str(tmp_path / "params.npz")!r}, **{{
    "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(x)
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
}})
open({str(tmp_path / "spm")!r}, "wb").write(spm)
"""
    env = child_env() | {"JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # What plain orbax read is what our own reader reads.
    step_dir = run / "checkpoints" / "2"
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        nn.unbox(abstract_params(LongT5(model_config(step_dir)))),
    )
    ours = restore_params(step_dir, target)
    read = np.load(tmp_path / "params.npz")
    flat = {
        "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(x)
        for path, x in jax.tree_util.tree_flatten_with_path(ours)[0]
    }
    assert set(flat) == set(read.files) and flat
    for name, value in flat.items():
        np.testing.assert_array_equal(read[name], value, err_msg=name)
    assert (tmp_path / "spm").read_bytes() == saved_tokenizer(step_dir)
