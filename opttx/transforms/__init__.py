"""Pure gradient transformations, one file per family.

Every name of ``__all__`` is also ``opttx.<name>``. A new module here is documented on the
API pages without editing them (docs/_ext/transform_modules.py); its public names are
exported by adding them below, one import and one ``__all__`` group per family.
"""

from .ademamix import ScaleByAdemamixState, scale_by_ademamix
from .adopt import ScaleByAdoptState, scale_by_adopt
from .blocking import block_by_dims, block_shapes, merge_small_dims
from .block_periodic import (OrthogonalizeBlockPeriodicState, block_sizes,
                             orthogonalize_block_periodic)
from .cautious import cautious
from .clipping import (ZeroNansState, clip, clip_by_block_rms, clip_by_global_norm, global_norm,
                       zero_nans)
from .dion import (ScaleByDion2State, ScaleByDionState, dion_rank, scale_by_dion,
                   scale_by_dion2)
from .factored import (FactoredState, ScaleByCameState, add_step_scaled_decayed_weights,
                       clip_by_rms, clip_by_rms_and_scale_by_param_rms, factored_axes,
                       relative_step_schedule, scale_by_came, scale_by_factored_rms,
                       scale_by_param_block_rms, scale_by_trust_ratio)
from .grafting import (DiagonalGraftState, GraftState, graft, meta_bias_correction,
                       scale_by_grafted_diagonal)
from .hyperball import HyperballState, hyperball_step
from .kron import ScaleByKronState, scale_by_kron
from .kronecker_factors import pack_symmetric, unpack_symmetric
from .lowrank import ProjectLowrankState, project_lowrank
from .mars import ScaleByMarsState, scale_by_mars
from .matrix_functions import (inverse_root_from_eigendecomposition, matrix_eigendecomposition,
                               matrix_inverse_root)
from .moments import (DampedTraceState, EmaState, ScaleByAdamState, ScaleByAdamaxState,
                      ScaleByAmsgradState, ScaleByBeliefState, ScaleByLionState,
                      ScaleByNadamState, ScaleByRadamState, ScaleByRmsState, ScaleByRssState,
                      ScaleByStddevState, TraceState, ema, scale_by_adam, scale_by_adamax,
                      scale_by_belief, scale_by_lion, scale_by_nadam, scale_by_radam,
                      scale_by_rms, scale_by_rss, scale_by_stddev, trace)
from .muon_clip import MaxAttentionLogits, QKWeight, clip_qk
from .normuon import ScaleByNeuronRmsState, scale_by_neuron_rms, scale_to_orthogonal_norm
from .orthogonalize import (NS_COEFFS, POLAR_EXPRESS_COEFFS, gram_newton_schulz, newton_schulz,
                            normalize_frobenius, orthogonalize, polar_factor, scale_by_shape)
from .prodigy import ProdigyState, scale_by_prodigy
from .quantized import (CorrectedTensor, LeafSlot, QuantizationMap, QuantizedState,
                        QuantizedTensor, StateLayout, dequantize_blockwise, dynamic_map,
                        linear_map, quantization_map, quantize_blockwise, quantize_state)
from .scaling import (ScaleByScheduleState, add_decayed_weights, scale, scale_by_learning_rate,
                      scale_by_schedule, scale_by_sign)
from .schedule_free import (ScheduleFreeState, schedule_free, schedule_free_eval_params,
                            schedule_free_train_params)
from .shampoo import ShampooState, precondition_shampoo
from .lookahead import LookaheadState, lookahead, lookahead_slow_params
from .soap import (EigenvalueCorrectedState, merge_dims_heavyball, merge_dims_soap,
                   precondition_eigenvalue_corrected)
from .weight_ema import EmaParamsState, ema_decay, ema_eval_params, ema_params

__all__ = [
    # scaling: constant factors, learning rates, schedules, weight decay, sign
    "scale", "scale_by_learning_rate", "scale_by_schedule", "ScaleByScheduleState",
    "add_decayed_weights", "scale_by_sign",
    # moments: momentum, EMAs, Adam and its relatives, RMS, RSS, Lion
    "trace", "TraceState", "DampedTraceState", "ema", "EmaState", "scale_by_adam",
    "ScaleByAdamState", "ScaleByAmsgradState", "scale_by_adamax", "ScaleByAdamaxState",
    "scale_by_nadam", "ScaleByNadamState", "scale_by_radam", "ScaleByRadamState",
    "scale_by_belief", "ScaleByBeliefState", "scale_by_rms", "ScaleByRmsState",
    "scale_by_rss", "ScaleByRssState", "scale_by_stddev", "ScaleByStddevState",
    "scale_by_lion", "ScaleByLionState",
    # clipping and NaN zeroing
    "clip", "clip_by_block_rms", "clip_by_global_norm", "global_norm", "zero_nans",
    "ZeroNansState",
    # ADOPT, AdEMAMix, MARS, Prodigy, Schedule-Free, cautious updates
    "scale_by_adopt", "ScaleByAdoptState", "scale_by_ademamix", "ScaleByAdemamixState",
    "scale_by_mars", "ScaleByMarsState", "scale_by_prodigy", "ProdigyState",
    "schedule_free", "ScheduleFreeState", "schedule_free_eval_params",
    "schedule_free_train_params", "cautious",
    # factored second moments and layer-wise scalings (Adafactor, CAME, LAMB, LARS)
    "scale_by_factored_rms", "FactoredState", "factored_axes", "scale_by_came",
    "ScaleByCameState", "clip_by_rms", "clip_by_rms_and_scale_by_param_rms",
    "scale_by_param_block_rms", "scale_by_trust_ratio", "add_step_scaled_decayed_weights",
    "relative_step_schedule",
    # the Muon family: orthogonalization, NorMuon, Dion, MuonClip's QK-clip, PSGD-Kron
    "orthogonalize", "newton_schulz", "gram_newton_schulz", "polar_factor",
    "normalize_frobenius", "scale_by_shape", "NS_COEFFS", "POLAR_EXPRESS_COEFFS",
    "scale_by_neuron_rms", "ScaleByNeuronRmsState", "scale_to_orthogonal_norm",
    "scale_by_dion", "ScaleByDionState", "scale_by_dion2", "ScaleByDion2State", "dion_rank",
    "clip_qk", "QKWeight", "MaxAttentionLogits", "scale_by_kron", "ScaleByKronState",
    # Shampoo: blocking, grafting, preconditioning, its factors and matrix functions
    "block_by_dims", "block_shapes", "merge_small_dims", "precondition_shampoo",
    "ShampooState", "graft", "GraftState", "scale_by_grafted_diagonal", "DiagonalGraftState",
    "meta_bias_correction", "matrix_inverse_root", "matrix_eigendecomposition",
    "inverse_root_from_eigendecomposition", "pack_symmetric", "unpack_symmetric",
    # SOAP: eigenvalue-corrected Shampoo
    "precondition_eigenvalue_corrected", "EigenvalueCorrectedState", "merge_dims_soap",
    "merge_dims_heavyball",
    # memory-lean: low-rank projections (GaLore) and compressed states
    "project_lowrank", "ProjectLowrankState", "quantize_state", "QuantizedState",
    "QuantizedTensor", "CorrectedTensor", "StateLayout", "LeafSlot", "QuantizationMap",
    "quantization_map", "dynamic_map", "linear_map", "quantize_blockwise",
    "dequantize_blockwise",
    # weight EMA: an average of the parameters in the optimizer state
    "ema_params", "EmaParamsState", "ema_decay", "ema_eval_params",
    # outer optimizers: lookahead
    "lookahead", "LookaheadState", "lookahead_slow_params",
    # MuonBP: block-wise orthogonalization, the whole matrix every few steps
    "orthogonalize_block_periodic", "OrthogonalizeBlockPeriodicState", "block_sizes",
    # Hyperball: weight and update norms held fixed in place of weight decay
    "hyperball_step", "HyperballState",
]
