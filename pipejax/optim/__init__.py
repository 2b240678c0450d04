"""optax transformations for pipelined training: delays, their compensation, and scaling rules.

Every transformation is an ``optax.GradientTransformationExtraArgs`` usable in any JAX code, and
works under ``optax.inject_hyperparams``; helpers beside them derive the weights a forward or
backward pass should use (as optax's ``schedule_free_eval_params`` does).
"""

from pipejax.optim.adam_family import (AdamPredictionState, ScaleByTorchNAdamState,
                                       adam_predicted_params, adam_weight_prediction,
                                       asyncpp_learning_rate, asyncpp_momentum, decay_mask,
                                       nesterov_asyncpp, scale_by_torch_nadam)
from pipejax.optim.compensation import delay_compensation
from pipejax.optim.delay import DelayGradientsState, delay_gradients
from pipejax.optim.error_feedback import (DelayedErrorFeedbackState, delayed_error_feedback,
                                          error_feedback_virtual_params)
from pipejax.optim.muon_sc import ScaleByMuonSCState, muon_sc, scale_by_muon_sc
from pipejax.optim.pipemare import (DEFAULT_GAMMA, PipeMareState, pipemare,
                                    pipemare_backward_params, pipemare_discrepancy,
                                    pipemare_learning_rate)
from pipejax.optim.precision import float32_state
from pipejax.optim.prediction import (WeightPredictionState, linear_weight_prediction,
                                      predicted_params)
from pipejax.optim.scaling import Recipe, scale_recipe, steps_for_samples
from pipejax.optim.spike import (ScaleByAdamSCState, SpikeCompensationState, adam_sc, sgd_sc,
                                 scale_by_adam_sc, spike_coefficients, spike_compensation)

__all__ = [
    'AdamPredictionState',
    'DEFAULT_GAMMA',
    'DelayGradientsState',
    'DelayedErrorFeedbackState',
    'PipeMareState',
    'Recipe',
    'ScaleByAdamSCState',
    'ScaleByMuonSCState',
    'ScaleByTorchNAdamState',
    'SpikeCompensationState',
    'WeightPredictionState',
    'adam_predicted_params',
    'adam_sc',
    'adam_weight_prediction',
    'asyncpp_learning_rate',
    'asyncpp_momentum',
    'decay_mask',
    'delay_compensation',
    'delay_gradients',
    'delayed_error_feedback',
    'float32_state',
    'error_feedback_virtual_params',
    'linear_weight_prediction',
    'muon_sc',
    'nesterov_asyncpp',
    'pipemare',
    'pipemare_backward_params',
    'pipemare_discrepancy',
    'pipemare_learning_rate',
    'predicted_params',
    'scale_by_adam_sc',
    'scale_by_muon_sc',
    'scale_by_torch_nadam',
    'scale_recipe',
    'sgd_sc',
    'spike_coefficients',
    'spike_compensation',
    'steps_for_samples',
]
