"""The fused attention kernels (Pallas; Triton on a GPU, interpreted on a CPU), one module a
concept. The model calls them through `interface` only; the plain-JAX attention they replace
(`model.attention`, `model.long_attention`) stays the spec.

Map, from what the model sees down:
- `interface`: `encoder_attention`, `decoder_attention`, `Side`; `resolve` / `fused` (which
  attention runs: the backend seam) and `unusable` (why the kernels cannot be built here).
- `encoder`: the encoder's (Local and TGlobal) forward kernel and its custom VJP;
  `encoder_grad`: its backward kernels (dq, local dk dv, local bias, side keys and bias);
  `encoder_geometry`: a call's static geometry (`Geometry`, the FLOPs each kernel declares);
  `encoder_tiles`: block specs and the masked scores of local and side keys.
- `decoder`: the decoder's kernels (causal self-attention with its bias, cross-attention) and
  their custom VJP; `decoder_tiles`: its tiles, block specs and operands, and `combine` (a
  query tile's split parts as one output).
- `softmax`: the online softmax, NEG and -inf masks, float32-exact matmuls, the GPU's exp.
- `dropout`: attention dropout's counter hash (the XLA path draws the same bits) and a
  kernel's dropout inputs (`Drop`, their block specs `whole_drop`).
- `call`: one `pallas_call`, Triton or interpreted by platform (`filled`: a record of block
  specs, one spec in all but the named fields); `launch`: each kernel's warps, stages and
  splits by name (`LAUNCH`, `KERNELS`); `backend`: the GPUs they compile for; `placement`:
  each device's rows and heads under the placement `parallel.sharding` installs (the kernels
  never see the mesh; `on_own_records` places a call of named records); `by_distance`:
  gradients summed by distance.
- Their reference, `longt5_jax.kernel_checks` (a layer above the model, `tests/test_shape.py`):
  a model layer as a problem, its loss and gradients with either attention, their relative
  errors.

To add a kernel: write it as a module here beside the code it replaces (name it in
`launch.KERNELS`, with a `LAUNCH` pattern if it needs its own warps and stages, and declare
its FLOPs in the name `call.call` gives it); reach it from `interface`, and from the model's
attention module through `interface.fused`; test it in `tests/test_<name>_kernel.py` against
the XLA path with `kernel_checks` (`layer_problem` or your own problem, `run_layer`,
`relative_errors`) at the tests' TOLERANCE, on CPU (interpreted), and compile it deviceless for
a GPU (`tests/test_long_attention_kernel.py` shows both). `bench kernels` then times it on a
GPU (a new kind of layer: its case in `kernel_checks.parse_case` and `case_problem`, its kernels'
prefix in `bench/kernels.py`'s `family`), `bench sass` reads its registers, `bench roofline`
its bytes. Files a new kernel touches: its module (and its tiles' if they are many), `launch`,
`interface`, the model's attention module, its test file, and docs/journal.md's kernels
section for what it measured.

The backend seam: `interface.resolve` makes `attention_kernel="auto"` concrete per device and
backend. A Mosaic GPU implementation (Hopper and later: warpgroup matmuls, TMA, warp
specialisation) would plug in there: its own `call` (`plgpu.CompilerParams` of Mosaic, a
`pallas_call` without the Triton params), its bodies written to Mosaic's refs and barriers (the
online softmax of `softmax` is plain jnp and carries over, the inline PTX of `softmax.exp` does
not), a capability test in `backend` (compute capability 9.0 and later), and `resolve` choosing
it before Triton where it lowers. None is written: it needs a GPU to time it against Triton's.
"""
