"""pipejax: fine-grained, asynchronous Pipelined Backpropagation in JAX."""

from pipejax.stages import Model, ModelError, Stage, from_flax, softmax_cross_entropy
