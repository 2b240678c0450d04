"""Tests for pipejax.models: split networks equal unsplit references, sliced conv equals nn.Conv.

The references below are written the conventional way (one flax module per network, residual
blocks as submodules, XLA's ``nn.Conv`` and ``nn.max_pool``), independently of the layer/stage
machinery; their parameters are mapped onto the stages' ``{layer_name: params}`` by hand.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax
from pipejax import models

RTOL = ATOL = 2e-5
# GroupNorm groups the builders use by default (norm_groups=8, gcd with the channel count),
# written out as a table so the references do not share the builders' rule.
GROUPS_8 = {2: 2, 4: 4, 8: 8, 16: 8, 32: 8, 64: 8}


# ---------------------------------------------------------------------------------------------
# Independent reference networks.


class RefMLP(nn.Module):
  hidden: tuple
  num_classes: int
  layer_norm: bool

  @nn.compact
  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    for i, width in enumerate(self.hidden):
      x = nn.Dense(width, use_bias=not self.layer_norm, name=f"dense{i}")(x)
      if self.layer_norm:
        x = nn.LayerNorm(name=f"ln{i}")(x)
      x = nn.relu(x)
    return nn.Dense(self.num_classes, name="out")(x)


class RefConvNet(nn.Module):
  """Conv stack ('M' = 2x2 max pool), flatten, dense layers with LayerNorm, logits."""
  config: tuple
  dense: tuple
  num_classes: int

  @nn.compact
  def __call__(self, x):
    k = 0
    for item in self.config:
      if item == "M":
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        continue
      x = nn.Conv(item, (3, 3), padding="SAME", use_bias=False, name=f"c{k}")(x)
      x = nn.relu(nn.GroupNorm(num_groups=GROUPS_8[item], name=f"gn{k}")(x))
      k += 1
    x = x.reshape(x.shape[0], -1)
    for i, width in enumerate(self.dense):
      x = nn.relu(nn.LayerNorm(name=f"ln{i}")(nn.Dense(width, use_bias=False, name=f"d{i}")(x)))
    return nn.Dense(self.num_classes, name="out")(x)


def _ref_shortcut(x, features, strides, shortcut):
  if x.shape[-1] == features and strides == 1:
    return x
  if shortcut == "projection":
    x = nn.Conv(features, (1, 1), strides=strides, use_bias=False, name="proj_conv")(x)
    return nn.GroupNorm(num_groups=GROUPS_8[features], name="proj_norm")(x)
  x = x[:, ::strides, ::strides, :]
  extra = features - x.shape[-1]
  return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (extra // 2, extra - extra // 2)))


class RefBasicBlock(nn.Module):
  features: int
  strides: int
  shortcut: str

  @nn.compact
  def __call__(self, x):
    y = nn.Conv(self.features, (3, 3), self.strides, padding="SAME", use_bias=False,
                name="conv1")(x)
    y = nn.relu(nn.GroupNorm(num_groups=GROUPS_8[self.features], name="norm1")(y))
    y = nn.Conv(self.features, (3, 3), padding="SAME", use_bias=False, name="conv2")(y)
    y = nn.GroupNorm(num_groups=GROUPS_8[self.features], name="norm2")(y)
    return nn.relu(y + _ref_shortcut(x, self.features, self.strides, self.shortcut))


class RefCifarResNet(nn.Module):
  blocks_per_group: int
  width: int
  num_classes: int
  shortcut: str

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(self.width, (3, 3), padding="SAME", use_bias=False, name="stem_conv")(x)
    x = nn.relu(nn.GroupNorm(num_groups=GROUPS_8[self.width], name="stem_norm")(x))
    for g in range(3):
      for b in range(self.blocks_per_group):
        x = RefBasicBlock(self.width * 2 ** g, 2 if g and not b else 1, self.shortcut,
                          name=f"block{g}_{b}")(x)
    return nn.Dense(self.num_classes, name="fc")(x.mean(axis=(1, 2)))


class RefBottleneck(nn.Module):
  features: int
  strides: int

  @nn.compact
  def __call__(self, x):
    groups = lambda c: math.gcd(32, c)  # resnet50's default norm_groups=32.
    y = nn.Conv(self.features, (1, 1), use_bias=False, name="conv1")(x)
    y = nn.relu(nn.GroupNorm(num_groups=groups(self.features), name="norm1")(y))
    y = nn.Conv(self.features, (3, 3), self.strides, padding="SAME", use_bias=False,
                name="conv2")(y)
    y = nn.relu(nn.GroupNorm(num_groups=groups(self.features), name="norm2")(y))
    y = nn.Conv(4 * self.features, (1, 1), use_bias=False, name="conv3")(y)
    y = nn.GroupNorm(num_groups=groups(4 * self.features), name="norm3")(y)
    if x.shape != y.shape:
      x = nn.Conv(4 * self.features, (1, 1), self.strides, use_bias=False, name="proj_conv")(x)
      x = nn.GroupNorm(num_groups=groups(4 * self.features), name="proj_norm")(x)
    return nn.relu(x + y)


class RefResNet50(nn.Module):
  blocks_per_group: tuple
  width: int
  num_classes: int

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(self.width, (7, 7), 2, padding="SAME", use_bias=False, name="stem_conv")(x)
    x = nn.relu(nn.GroupNorm(num_groups=math.gcd(32, self.width), name="stem_norm")(x))
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for g, num_blocks in enumerate(self.blocks_per_group):
      for b in range(num_blocks):
        x = RefBottleneck(self.width * 2 ** g, 2 if g and not b else 1, name=f"block{g}_{b}")(x)
    return nn.Dense(self.num_classes, name="fc")(x.mean(axis=(1, 2)))


def _conv_norm(p, conv, norm):
  return {"conv": p[conv], "norm": p[norm]}


def map_mlp(p, hidden, layer_norm):
  out = {}
  for i in range(len(hidden)):
    out[f"fc{i + 1}"] = {"dense": p[f"dense{i}"], **({"norm": p[f"ln{i}"]} if layer_norm else {})}
  out["head"] = {"dense": p["out"]}
  return out


def map_conv_net(p, num_convs, num_dense):
  out = {f"conv{k + 1}": _conv_norm(p, f"c{k}", f"gn{k}") for k in range(num_convs)}
  out.update({f"fc{i + 1}": {"dense": p[f"d{i}"], "norm": p[f"ln{i}"]} for i in range(num_dense)})
  out["head"] = {"dense": p["out"]}
  return out


def map_cifar_resnet(p, blocks_per_group):
  out = {"stem": _conv_norm(p, "stem_conv", "stem_norm"), "head": {"dense": p["fc"]}}
  for g in range(3):
    for b in range(blocks_per_group):
      block = p[f"block{g}_{b}"]
      name = f"res{g + 1}_{b + 1}"
      out[f"{name}_conv1"] = _conv_norm(block, "conv1", "norm1")
      out[f"{name}_conv2"] = _conv_norm(block, "conv2", "norm2")
      out[f"{name}_conv2"].update({k: block[k] for k in ("proj_conv", "proj_norm") if k in block})
  return out


def map_resnet50(p, blocks_per_group):
  out = {"stem": _conv_norm(p, "stem_conv", "stem_norm"), "head": {"dense": p["fc"]}}
  for g, num_blocks in enumerate(blocks_per_group):
    for b in range(num_blocks):
      block = p[f"block{g}_{b}"]
      for k in (1, 2, 3):
        out[f"res{g + 1}_{b + 1}_conv{k}"] = _conv_norm(block, f"conv{k}", f"norm{k}")
      out[f"res{g + 1}_{b + 1}_conv3"].update(
          {k: block[k] for k in ("proj_conv", "proj_norm") if k in block})
  return out


# ---------------------------------------------------------------------------------------------
# Helpers.


def compose(model, stage_params, x):
  """Applies stage 0, then 1, ...: what the pipeline computes for one sample, minus the delays."""
  rng = jax.random.key(0)
  for stage, params in zip(model.stages, stage_params):
    x = stage.apply(params, x, rng)
  return x


def stage_params_for(model, layer_params, x):
  """Per-stage parameters from a layer dict, checked against the stages' own init shapes."""
  per_stage = models.split_layer_params(model, layer_params, x)
  init_shapes, _ = model.trace_shapes(jax.random.key(1), x)
  assert (jax.tree.map(lambda a: (a.shape, a.dtype), per_stage)
          == jax.tree.map(lambda a: (a.shape, a.dtype), init_shapes))
  return per_stage


def random_params(init, x, seed=0):
  """Random parameters shaped like ``init(rng, x)``'s, drawn with numpy (no RNG to compile).

  Kernels are scaled by 1/sqrt(fan-in); norm scales are 1 + noise and biases noise, so a
  swapped or dropped norm parameter cannot go unnoticed.
  """
  shapes = jax.eval_shape(init, jax.random.key(0), x)
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    noise = rng.standard_normal(leaf.shape).astype(np.float32)
    if len(leaf.shape) > 1:
      return jnp.asarray(noise / np.sqrt(math.prod(leaf.shape[:-1])))
    return jnp.asarray((1.0 if path[-1].key == "scale" else 0.0) + 0.1 * noise)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def flax_init(module):
  return lambda rng, x: module.init(rng, x)["params"]


def assert_split_equals_reference(model, ref, layer_params_fn, x):
  # Everything is jitted: eager flax runs compile every small op separately, which costs more
  # than one compile of the whole network on this 2-core machine.
  ref_params = random_params(flax_init(ref), x)
  expected = jax.jit(ref.apply)({"params": ref_params}, x)
  stage_params = stage_params_for(model, layer_params_fn(ref_params), x)
  got = jax.jit(functools.partial(compose, model))(stage_params, x)
  assert got.shape == expected.shape
  np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
  assert float(jnp.std(expected)) > 1e-3  # The comparison is not between two constants.
  return ref_params


def images(shape, seed=0):
  return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# Split == unsplit.


@pytest.mark.parametrize("layers_per_stage", [1, 2, None])  # None: one stage, no pipeline
@pytest.mark.parametrize("normalization", [None, "layer"])
def test_mlp_equals_reference(layers_per_stage, normalization):
  hidden = (16, 12, 8)
  model = models.mlp(hidden, num_classes=5, layers_per_stage=layers_per_stage,
                     normalization=normalization)
  assert model.num_stages == math.ceil(4 / (layers_per_stage or 4))
  ref = RefMLP(hidden, 5, normalization == "layer")
  assert_split_equals_reference(model, ref, lambda p: map_mlp(p, hidden, normalization), images(
      (3, 6, 6, 1)))


@pytest.mark.parametrize("layers_per_stage,conv_impl", [(1, "sliced"), (2, "xla")])
def test_small_cnn_equals_reference(layers_per_stage, conv_impl):
  # 10x10 -> 5x5 -> 2x2: the second pooling sees an odd size.
  model = models.small_cnn(widths=(4, 8), dense=(16,), num_classes=5,
                           layers_per_stage=layers_per_stage, conv_impl=conv_impl)
  assert model.num_stages == math.ceil(4 / layers_per_stage)
  ref = RefConvNet((4, "M", 8, "M"), (16,), 5)
  assert_split_equals_reference(model, ref, lambda p: map_conv_net(p, 2, 1), images((2, 10, 10, 1)))


def test_vgg_equals_reference():
  config = (4, "M", 8, 8, "M", 16, "M")
  model = models.vgg(config, num_classes=3, conv_impl="sliced")
  assert [s.name for s in model.stages] == ["conv1", "conv2", "conv3", "conv4", "head"]
  assert_split_equals_reference(model, RefConvNet(config, (), 3), lambda p: map_conv_net(p, 4, 0),
                                images((2, 8, 8, 3)))


@pytest.mark.parametrize("depth,layers_per_stage,shortcut,conv_impl", [
    (20, 1, "projection", "sliced"), (20, 2, "projection", "xla"), (8, 1, "pad", "sliced"),
    (8, 3, "projection", "sliced")])
def test_cifar_resnet_equals_reference(depth, layers_per_stage, shortcut, conv_impl):
  # Width 4 on 8x8 images: groups 2 and 3 start with a stride-2 block whose channels double, so
  # their shortcut is projected (or padded) in the block's last stage; other blocks add x.
  model = models.cifar_resnet(depth, width=4, num_classes=3, layers_per_stage=layers_per_stage,
                              shortcut=shortcut, conv_impl=conv_impl)
  assert model.num_stages == math.ceil(depth / layers_per_stage)
  blocks = (depth - 2) // 6
  ref = RefCifarResNet(blocks_per_group=blocks, width=4, num_classes=3, shortcut=shortcut)
  ref_params = assert_split_equals_reference(model, ref, lambda p: map_cifar_resnet(p, blocks),
                                             images((2, 8, 8, 3)))
  assert ("proj_conv" in ref_params["block1_0"]) == (shortcut == "projection")


def test_cifar_resnet_gradients_equal_reference():
  x, labels = images((2, 8, 8, 3)), jnp.array([0, 2])
  model = models.cifar_resnet(8, width=4, num_classes=3, conv_impl="sliced")
  ref = RefCifarResNet(blocks_per_group=1, width=4, num_classes=3, shortcut="projection")
  ref_params = random_params(flax_init(ref), x)

  def ref_loss(p):
    return model.loss(ref.apply({"params": p}, x), labels)[0]

  def split_loss(layer_params):
    return model.loss(compose(model, stage_params_for(model, layer_params, x), x), labels)[0]

  ref_grads = jax.jit(jax.grad(ref_loss))(ref_params)
  split_grads = jax.jit(jax.grad(split_loss))(map_cifar_resnet(ref_params, 1))
  mapped = map_cifar_resnet(ref_grads, 1)
  assert jax.tree.structure(split_grads) == jax.tree.structure(mapped)
  for got, want in zip(jax.tree.leaves(split_grads), jax.tree.leaves(mapped)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(mapped)) > 1e-3


def test_tiny_resnet50_equals_reference():
  # Two layers per stage put every bottleneck across a stage boundary at a different place:
  # [stem, conv1] [conv2, conv3] [conv1, conv2] [conv3, conv1] ...; the 1-per-stage case of
  # residual blocks is covered by the CIFAR ResNet tests.
  layers_per_stage = 2
  blocks = (2, 1)  # Group 1: projection at stride 1 (4 -> 16 channels); group 2: stride 2.
  model = models.resnet50(num_classes=3, width=4, blocks_per_group=blocks,
                          layers_per_stage=layers_per_stage, conv_impl="sliced")
  assert model.num_stages == math.ceil((1 + 3 * 3 + 1) / layers_per_stage)
  ref = RefResNet50(blocks, width=4, num_classes=3)
  assert_split_equals_reference(model, ref, lambda p: map_resnet50(p, blocks), images(
      (2, 16, 16, 3)))


def test_one_stage_equals_fine_grained_composition():
  x = images((2, 8, 8, 3))
  fine = models.cifar_resnet(8, width=4, num_classes=3, conv_impl="xla")
  whole = models.cifar_resnet(8, width=4, num_classes=3, conv_impl="xla", layers_per_stage=100)
  assert (fine.num_stages, whole.num_stages) == (8, 1)
  assert whole.stages[0].name == "stem..head"
  whole_params = [random_params(whole.stages[0].init, x)]
  fine_params = models.split_layer_params(fine, whole_params[0], x)
  assert [list(p) for p in fine_params] == [[s.name] for s in fine.stages]
  assert jax.tree.structure(models.merge_stage_params(fine_params)) == jax.tree.structure(
      whole_params[0])
  np.testing.assert_allclose(jax.jit(functools.partial(compose, whole))(whole_params, x),
                             jax.jit(functools.partial(compose, fine))(fine_params, x),
                             rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------------------
# Stage structure.


def test_stage_counts_and_names():
  resnet20 = models.build("cifar_resnet20")
  names = [s.name for s in resnet20.stages]
  # A weight layer is one conv or dense layer with its norm/activation/pooling: the stem conv,
  # 9 blocks x 2 convs, and the dense head. Shortcut projections are not layers of their own.
  assert len(names) == 20
  assert names[:4] == ["stem", "res1_1_conv1", "res1_1_conv2", "res1_2_conv1"]
  assert names[-3:] == ["res3_3_conv1", "res3_3_conv2", "head"]
  assert models.build("cifar_resnet20", layers_per_stage=2).num_stages == 10
  assert models.build("cifar_resnet20", layers_per_stage=3).num_stages == 7
  assert models.build("cifar_resnet110").num_stages == 110
  assert models.build("resnet50").num_stages == 50
  assert models.build("mlp").num_stages == 4
  assert models.build("small_cnn").num_stages == 4
  assert models.build("vgg").num_stages == 9  # VGG-11: 8 convs + head.


def test_describe_resnet20_pytrees_and_params():
  rows = models.describe(models.build("cifar_resnet20"), jnp.zeros((1, 32, 32, 3)))
  assert [r["stage"] for r in rows] == list(range(20))
  by_name = {r["name"]: r for r in rows}
  assert by_name["stem"]["input_shape"] == (1, 32, 32, 3)
  # A block's first stage carries the shortcut; its second stage takes (h, shortcut).
  assert by_name["res2_1_conv1"]["output_shape"] == ((1, 16, 16, 32), (1, 32, 32, 16))
  assert by_name["res2_1_conv2"]["input_shape"] == ((1, 16, 16, 32), (1, 32, 32, 16))
  assert by_name["res2_1_conv2"]["output_shape"] == (1, 16, 16, 32)
  # conv 3x3 32->32 + GroupNorm(32) + projection 1x1 16->32 + GroupNorm(32).
  assert by_name["res2_1_conv2"]["params"] == 9 * 32 * 32 + 64 + 16 * 32 + 64
  assert by_name["res2_2_conv2"]["params"] == 9 * 32 * 32 + 64
  assert by_name["head"]["output_shape"] == (1, 10)
  assert sum(r["params"] for r in rows) == 272_474
  pad_rows = models.describe(models.build("cifar_resnet20", shortcut="pad"),
                             jnp.zeros((1, 32, 32, 3)))
  assert sum(r["params"] for r in pad_rows) == 269_722  # He et al.'s 0.27M.


def test_resnet50_param_count():
  rows = models.describe(models.build("resnet50"), jax.ShapeDtypeStruct((1, 224, 224, 3),
                                                                        jnp.float32))
  # GroupNorm has BatchNorm's affine parameters, so this is torchvision's resnet50 count.
  assert sum(r["params"] for r in rows) == 25_557_032
  assert rows[0]["output_shape"] == (1, 56, 56, 64)
  assert rows[-2]["output_shape"] == (1, 7, 7, 2048)


def test_stage_input_shapes_are_stage_boundaries_at_layers_per_stage_2():
  rows = models.describe(models.cifar_resnet(8, width=4, layers_per_stage=2),
                         jnp.zeros((1, 8, 8, 3)))
  # [stem, res1_1_conv1] ends inside a block, so the next stage starts with (h, shortcut).
  assert [r["name"] for r in rows] == ["stem..res1_1_conv1", "res1_1_conv2..res2_1_conv1",
                                       "res2_1_conv2..res3_1_conv1", "res3_1_conv2..head"]
  assert rows[1]["input_shape"] == ((1, 8, 8, 4), (1, 8, 8, 4))
  assert rows[2]["input_shape"] == ((1, 4, 4, 8), (1, 8, 8, 4))


# ---------------------------------------------------------------------------------------------
# Sliced convolution and pooling.


@pytest.mark.parametrize("size,kernel,strides,padding", [
    (8, 3, 1, "SAME"), (7, 3, 1, "SAME"), (8, 3, 2, "SAME"), (7, 3, 2, "SAME"),
    (9, 1, 2, "SAME"), (16, 7, 2, "SAME"), (7, 3, 2, "VALID"), (6, (3, 1), (1, 2), "SAME"),
    (6, 3, 1, ((2, 0), (1, 1))),
])
def test_sliced_conv_equals_flax_conv(size, kernel, strides, padding):
  kernel = (kernel, kernel) if isinstance(kernel, int) else kernel
  x = images((2, size, size + 1, 3))
  conv = nn.Conv(5, kernel, strides=strides, padding=padding)
  sliced = models.SlicedConv(5, kernel, strides=strides, padding=padding)
  params = {"params": random_params(flax_init(conv), x)}
  cotangent = images(jax.eval_shape(conv.apply, params, x).shape, seed=1)

  def values_and_grads(module):
    return jax.jit(lambda p, x: (module.apply(p, x), jax.vjp(module.apply, p, x)[1](cotangent)))(
        params, x)

  got, want = values_and_grads(sliced), values_and_grads(conv)
  np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
  for got_grad, want_grad in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-4, atol=1e-5)
  assert float(jnp.abs(want[1][1]).max()) > 1e-2  # The input gradient is not trivially zero.


def test_sliced_conv_has_flax_conv_parameters():
  x = images((1, 5, 5, 3))
  for use_bias in (True, False):
    conv, sliced = nn.Conv(4, (3, 2), use_bias=use_bias), models.SlicedConv(4, (3, 2),
                                                                             use_bias=use_bias)
    # Same names, shapes and initializers: the same key gives the same parameters.
    jax.tree.map(np.testing.assert_array_equal, sliced.init(jax.random.key(0), x),
                 conv.init(jax.random.key(0), x))


def test_sliced_conv_takes_extra_batch_axes():
  x = images((2, 3, 5, 5, 2))
  conv, sliced = nn.Conv(4, (3, 3)), models.SlicedConv(4, (3, 3))
  params = {"params": random_params(flax_init(conv), x)}
  np.testing.assert_allclose(jax.jit(sliced.apply)(params, x), jax.jit(conv.apply)(params, x),
                             rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("size,window,stride,padding", [
    (8, 2, 2, "VALID"), (7, 2, 2, "VALID"), (8, 3, 2, "SAME"), (7, 3, 2, "SAME")])
def test_sliced_max_pool_equals_flax(size, window, stride, padding):
  x = images((2, size, size, 3))  # Continuous values: no ties.
  want = nn.max_pool(x, (window, window), strides=(stride, stride), padding=padding)
  np.testing.assert_array_equal(models.max_pool(x, window, stride, padding), want)
  weights = jnp.arange(want.size, dtype=jnp.float32).reshape(want.shape)
  grad = lambda f: jax.jit(jax.grad(lambda x: jnp.sum(f(x) * weights)))
  np.testing.assert_array_equal(
      grad(lambda x: models.max_pool(x, window, stride, padding))(x),
      grad(lambda x: nn.max_pool(x, (window, window), (stride, stride), padding))(x))


def test_conv_impl_choice_reaches_the_jaxpr():
  x = jnp.zeros((1, 8, 8, 3))
  primitives = {}
  for impl in ("sliced", "xla"):
    stage = models.cifar_resnet(8, width=4, conv_impl=impl).stages[0]
    params = jax.eval_shape(stage.init, jax.random.key(0), x)
    primitives[impl] = str(jax.make_jaxpr(stage.apply)(params, x, jax.random.key(0)))
  assert "conv_general_dilated" not in primitives["sliced"]
  assert "conv_general_dilated" in primitives["xla"]
  expected = "sliced" if jax.default_backend() == "cpu" else "xla"
  assert models.resolve_conv_impl("auto") == expected


# ---------------------------------------------------------------------------------------------
# Errors.


@pytest.mark.parametrize("name", ["mlp", "small_cnn", "vgg", "cifar_resnet20", "resnet50"])
def test_batch_norm_is_refused_with_reason(name):
  with pytest.raises(pipejax.ModelError, match=r"micro-batch size 1") as info:
    models.build(name, normalization="batch")
  message = str(info.value)
  assert "degenerate" in message and "normalization='online'" in message and "GroupNorm" in message


def test_unknown_model_lists_known_names():
  with pytest.raises(pipejax.ModelError, match="resnet18") as info:
    models.build("resnet18")
  for known in ("mlp", "small_cnn", "vgg", "cifar_resnet20", "cifar_resnet110", "resnet50"):
    assert known in str(info.value)


@pytest.mark.parametrize("kwargs", [
    dict(depth=21), dict(depth=20, layers_per_stage=0), dict(depth=20, conv_impl="cudnn"),
    dict(depth=20, shortcut="identity"), dict(depth=20, normalization="instance")])
def test_bad_arguments_are_model_errors(kwargs):
  with pytest.raises(pipejax.ModelError):
    models.cifar_resnet(**kwargs)


def test_residual_stage_refuses_a_plain_array():
  model = models.cifar_resnet(8, width=4)
  stage = model.stages[2]  # res1_1_conv2 expects (h, shortcut).
  with pytest.raises(pipejax.ModelError, match=r"\(h, shortcut\)"):
    stage.init(jax.random.key(0), jnp.zeros((1, 8, 8, 4)))


def test_plain_layer_refuses_an_unfinished_residual_block():
  model = models.stack_layers([
      ("conv1", models.ResidualConvLayer("first", 4, conv_impl="sliced")),
      ("head", models.DenseLayer(3, activation=None))])
  with pytest.raises(pipejax.ModelError, match="left unfinished"):
    model.trace_shapes(jax.random.key(0), jnp.zeros((1, 4, 4, 4)))


@pytest.mark.parametrize("name", models.names())
def test_every_registered_name_builds_with_its_defaults_and_is_documented(name):
  model = models.build(name)
  assert model.num_stages >= 1
  assert len({stage.name for stage in model.stages}) == model.num_stages  # names label metrics
  # build()'s docstring lists what a config may name ('cifar_resnet20' (32, 44, ...) once).
  assert f"'{name.rstrip('0123456789')}" in models.build.__doc__, name


@pytest.mark.parametrize("label_shape", [(4,), (4, 3)])
def test_the_default_loss_is_optax_cross_entropy_over_every_label(label_shape):
  # (4,) labels for (4, 10) logits, and per-token (4, 3) labels for (4, 3, 10) logits.
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.standard_normal(label_shape + (10,)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 10, label_shape), jnp.int32)
  loss, metrics = pipejax.softmax_cross_entropy(logits, labels)
  expected = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  np.testing.assert_allclose(metrics["accuracy"], jnp.mean(jnp.argmax(logits, -1) == labels))


def test_a_stage_that_merges_samples_is_refused():
  class Flatten(nn.Module):  # (b, 8) -> (1, 8 b): mixes the micro-batch's samples
    @nn.compact
    def __call__(self, x):
      return nn.Dense(10)(x.reshape(1, -1))

  model = pipejax.Model([pipejax.from_flax(nn.Dense(8)), pipejax.from_flax(Flatten())])
  with pytest.raises(pipejax.ModelError, match=r"turns a micro-batch of 4 into outputs of shape "
                     r"\(1, 10\): every output of a stage must keep the leading micro-batch axis"):
    model.trace_shapes(jax.random.PRNGKey(0), jnp.zeros((4, 5)))


def test_from_flax_and_model_name_what_they_take():
  with pytest.raises(pipejax.ModelError, match=r"from_flax\(Dense\(...\)\) with its arguments"):
    pipejax.from_flax(nn.Dense)
  with pytest.raises(pipejax.ModelError, match="takes a flax linen module.*got function"):
    pipejax.from_flax(lambda x: x)
  with pytest.raises(pipejax.ModelError, match=r"Model\(\[stage\]\) for a single one"):
    pipejax.Model(pipejax.from_flax(nn.Dense(3)))
  stage = pipejax.from_flax(nn.Dense(3), input_shape=5)  # an int is one axis
  assert stage.input_shape == (5,)
