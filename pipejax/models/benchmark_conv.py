"""Measures XLA's conv against :class:`SlicedConv` for training steps inside ``lax.scan``.

docs/design.md §9: conv backprop inside ``lax.scan`` is slow on XLA:CPU. This times SGD steps
(value_and_grad + update) at micro-batch size 1, both as a ``lax.scan`` over steps (how the
pipeline's tick loop runs) and as a Python loop over a jitted step, for

- 'block': one ResNet-20 basic block (16 channels, 32x32, two 3x3 convs + GroupNorm);
- 'resnet20': the whole CIFAR ResNet-20 from :func:`pipejax.models.cifar_resnet`, its 20
  stages composed.

Run: ``python -m pipejax.models.benchmark_conv [--steps 20] [--reps 3]``. Prints samples/s.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from jax import lax

from pipejax.models import blocks, resnet, sequential


def _block_loss(conv_impl: str):
  layers = [("res1_1_conv1", blocks.ResidualConvLayer("first", 16, conv_impl=conv_impl)),
            ("res1_1_conv2", blocks.ResidualConvLayer("last", 16, conv_impl=conv_impl))]
  return _chain_loss(layers, (1, 32, 32, 16))


def _resnet20_loss(conv_impl: str):
  return _chain_loss(resnet.cifar_resnet_layers(20, conv_impl=conv_impl), (1, 32, 32, 3))


def _chain_loss(layers, input_shape):
  model = sequential.stack_layers(layers, layers_per_stage=len(layers))
  stage = model.stages[0]
  x = jnp.zeros(input_shape)
  params = stage.init(jax.random.key(0), x)

  def loss(params, x):
    y = stage.apply(params, x, jax.random.key(0))
    return jnp.mean(y.astype(jnp.float32) ** 2)

  return loss, params, input_shape


def measure(net: str, conv_impl: str, steps: int, reps: int) -> tuple[float, float]:
  """Returns (samples/s inside lax.scan, samples/s as a loop of jitted steps), best of reps."""
  loss, params, input_shape = {"block": _block_loss, "resnet20": _resnet20_loss}[net](conv_impl)

  def step(params, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    return jax.tree.map(lambda w, g: w - 0.01 * g, params, grads), value

  inputs = jax.random.normal(jax.random.key(1), (steps,) + input_shape)
  scanned = jax.jit(lambda p, xs: lax.scan(step, p, xs))
  jitted_step = jax.jit(step)
  jax.block_until_ready(scanned(params, inputs))
  jax.block_until_ready(jitted_step(params, inputs[0]))
  best_scan = best_loop = float("inf")
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(scanned(params, inputs))
    best_scan = min(best_scan, time.perf_counter() - start)
    start = time.perf_counter()
    p = params
    for i in range(steps):
      p, _ = jitted_step(p, inputs[i])
    jax.block_until_ready(p)
    best_loop = min(best_loop, time.perf_counter() - start)
  return steps / best_scan, steps / best_loop


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--nets", default="block,resnet20")
  args = parser.parse_args()
  print(f"backend: {jax.default_backend()}, jax {jax.__version__}")
  for net in args.nets.split(","):
    for conv_impl in ("xla", "sliced"):
      in_scan, jitted = measure(net, conv_impl, args.steps, args.reps)
      print(f"{net:9s} {conv_impl:7s} in lax.scan: {in_scan:8.1f} samples/s   "
            f"jitted step loop: {jitted:8.1f} samples/s", flush=True)


if __name__ == "__main__":
  main()
