"""Pure gradient transformations, one file per family."""

from .ademamix import ScaleByAdemamixState, scale_by_ademamix
from .adopt import ScaleByAdoptState, scale_by_adopt
from .cautious import cautious
from .clipping import (ZeroNansState, clip, clip_by_block_rms, clip_by_global_norm, global_norm,
                       zero_nans)
from .factored import (FactoredState, ScaleByCameState, add_step_scaled_decayed_weights,
                       clip_by_rms, clip_by_rms_and_scale_by_param_rms, factored_axes,
                       relative_step_schedule, scale_by_came, scale_by_factored_rms,
                       scale_by_param_block_rms, scale_by_trust_ratio)
from .lowrank import ProjectLowrankState, project_lowrank
from .moments import (DampedTraceState, EmaState, ScaleByAdamState, ScaleByAdamaxState,
                      ScaleByAmsgradState, ScaleByBeliefState, ScaleByLionState,
                      ScaleByNadamState, ScaleByRadamState, ScaleByRmsState, ScaleByRssState,
                      ScaleByStddevState, TraceState, ema, scale_by_adam, scale_by_adamax,
                      scale_by_belief, scale_by_lion, scale_by_nadam, scale_by_radam,
                      scale_by_rms, scale_by_rss, scale_by_stddev, trace)
from .orthogonalize import newton_schulz, orthogonalize, polar_factor, scale_by_shape
from .mars import ScaleByMarsState, scale_by_mars
from .prodigy import ProdigyState, scale_by_prodigy
from .schedule_free import (ScheduleFreeState, schedule_free, schedule_free_eval_params,
                            schedule_free_train_params)
from .quantized import (CorrectedTensor, LeafSlot, QuantizationMap, QuantizedState,
                        QuantizedTensor, StateLayout, dequantize_blockwise, dynamic_map,
                        linear_map, quantization_map, quantize_blockwise, quantize_state)
from .scaling import (ScaleByScheduleState, add_decayed_weights, scale, scale_by_learning_rate,
                      scale_by_schedule, scale_by_sign)
from .shampoo import (DiagonalGraftState, GraftState, ShampooState, block_by_dims, block_shapes,
                      graft, inverse_root_from_eigendecomposition, matrix_eigendecomposition,
                      matrix_inverse_root, merge_small_dims, meta_bias_correction,
                      pack_symmetric, precondition_shampoo, scale_by_grafted_diagonal,
                      unpack_symmetric)
from .soap import (EigenvalueCorrectedState, merge_dims_heavyball, merge_dims_soap,
                   precondition_eigenvalue_corrected)

__all__ = [
    "ProjectLowrankState", "project_lowrank",
    "CorrectedTensor", "LeafSlot", "QuantizationMap", "QuantizedState", "QuantizedTensor",
    "StateLayout", "dequantize_blockwise", "dynamic_map", "linear_map", "quantization_map",
    "quantize_blockwise", "quantize_state",
    "GraftState", "ShampooState", "block_by_dims", "block_shapes", "graft",
    "matrix_inverse_root", "merge_small_dims", "precondition_shampoo",
    "DiagonalGraftState", "meta_bias_correction", "scale_by_grafted_diagonal",
    "pack_symmetric", "unpack_symmetric", "matrix_eigendecomposition",
    "inverse_root_from_eigendecomposition",
    "EigenvalueCorrectedState", "precondition_eigenvalue_corrected", "merge_dims_soap",
    "merge_dims_heavyball",
    "FactoredState", "ScaleByCameState", "add_step_scaled_decayed_weights", "clip_by_rms",
    "clip_by_rms_and_scale_by_param_rms",
    "factored_axes", "relative_step_schedule", "scale_by_came", "scale_by_factored_rms",
    "scale_by_param_block_rms", "scale_by_trust_ratio",
    "EmaState", "ScaleByAdamState", "ScaleByLionState", "ScaleByNadamState", "ScaleByRmsState",
    "ScaleByRssState", "ScaleByScheduleState", "ScaleByStddevState", "TraceState",
    "ZeroNansState", "add_decayed_weights", "clip", "clip_by_block_rms", "clip_by_global_norm",
    "ema", "global_norm", "scale", "scale_by_adam", "scale_by_learning_rate", "scale_by_lion",
    "scale_by_nadam", "scale_by_rms", "scale_by_rss", "scale_by_schedule", "scale_by_sign",
    "scale_by_stddev", "trace", "zero_nans",
    "DampedTraceState", "ScaleByAdamaxState", "ScaleByAmsgradState", "ScaleByBeliefState",
    "ScaleByRadamState", "scale_by_adamax", "scale_by_belief", "scale_by_radam",
    "newton_schulz", "orthogonalize", "polar_factor", "scale_by_shape",
    "ScaleByMarsState", "scale_by_mars",
    "cautious",
    "ProdigyState", "scale_by_prodigy",
    "ScheduleFreeState", "schedule_free", "schedule_free_eval_params",
    "schedule_free_train_params", "ScaleByAdoptState", "scale_by_adopt",
    "ScaleByAdemamixState", "scale_by_ademamix"]

# the Muon family
from .orthogonalize import (NS_COEFFS, POLAR_EXPRESS_COEFFS, gram_newton_schulz,  # noqa: E402
                            normalize_frobenius)

__all__ += ["NS_COEFFS", "POLAR_EXPRESS_COEFFS", "gram_newton_schulz", "normalize_frobenius"]
from .dion import (ScaleByDion2State, ScaleByDionState, dion_rank, scale_by_dion,  # noqa: E402
                   scale_by_dion2)
from .normuon import (ScaleByNeuronRmsState, scale_by_neuron_rms,  # noqa: E402
                      scale_to_orthogonal_norm)

__all__ += ["ScaleByDion2State", "ScaleByDionState", "dion_rank", "scale_by_dion",
            "scale_by_dion2", "ScaleByNeuronRmsState", "scale_by_neuron_rms",
            "scale_to_orthogonal_norm"]
from .muon_clip import MaxAttentionLogits, QKWeight, clip_qk  # noqa: E402

__all__ += ["MaxAttentionLogits", "QKWeight", "clip_qk"]
from .kron import ScaleByKronState, scale_by_kron  # noqa: E402

__all__ += ["ScaleByKronState", "scale_by_kron"]
