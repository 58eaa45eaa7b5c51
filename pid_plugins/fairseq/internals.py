"""Every fairseq internal the adapter reads (and the one Python internal its compatibility hook relies on), in one
place: what, why, which versions, and the check that runs where the adapter first uses it
(:meth:`pid_plugins.versions.Internal.require`).

fairseq's public extension points carry most of the adapter: ``--user-dir``, ``register_model`` /
``register_model_architecture``, the config dataclasses, the model's builder hooks (``build_model``,
``build_decoder_layer``, ``build_self_attention``) and ``upgrade_state_dict_named``. What is left: the incremental
state of ``MultiheadAttention`` (its private buffer accessors and layout), the parts of fairseq's attention, decoder
layer, decoder and language model that the method classes compute (or build) again with the method's step in between,
the ``torch`` global ``checkpoint_utils`` loads through, ``numpy.compat`` (gone in NumPy 2), the ``param_group``
attribute ``--optimizer composite`` reads, and Python's ``dataclasses._get_field`` (the hook that lets fairseq 0.12.2
import on Python 3.11). If one of these changes, the user gets :class:`~pid_plugins.versions.InternalChanged` naming
the version and the tested range, never a different result.

How each check sees a change: by behaviour where it can. The attention, its incremental buffer, the decoder layer,
the decoder and build_model are checked by five probes (:mod:`pid_plugins.fairseq.probes`: the stock part and the
method's on the same weights, their outputs compared; see the comment above ``PROBES``), the checkpoint global by
calling fairseq's loaders with a stand-in torch, the parameter groups by building fairseq's composite optimizer, and
Python's dataclass rule by calling Python's function; signatures are compared too. Source text is read only where no
probe can see the change, each with its reason in the check: the options ``build_model`` reads and the attributes the
layer's and the decoder's forwards read (an option a release adds changes nothing at its default), and the
``numpy.compat`` names fairseq reads (on paths that run only over data).

fairseq is imported inside the checks only.
"""
from __future__ import annotations

import inspect
import platform
import re
from typing import Any, Callable, Dict

from ..versions import Internal, parameters, reads, require

__all__ = ["INTERNALS", "PythonInternal", "require_all"]

ZOO = "fairseq"


class PythonInternal(Internal):
    """An internal of Python itself (not of a zoo): the message names Python's version and the versions the internal
    is known to hold in (Python has no entry in :data:`~pid_plugins.versions.TESTED`)."""

    def message(self, detail: str = "") -> str:
        extra = f" ({detail})" if detail else ""
        return (
            f"Python {platform.python_version()} changed an internal pid-plugins reads: {self.name}{extra}, needed for "
            f"{self.why}. It is known to hold in Python {self.versions}; run fairseq under one of those, or report it "
            "with this message. Nothing was computed with the changed internal."
        )


# ------------------------------------------------------------------------------------------------------ checks
# The method classes compute fairseq's MultiheadAttention (with its incremental buffer), TransformerDecoderLayerBase and
# TransformerDecoderBase again with the method's step in between, and transformer_lm_pid builds what
# TransformerLanguageModel.build_model builds. Whether they still do is checked by behaviour, not by reading fairseq's
# source: five probes (pid_plugins/fairseq/probes.py) build the stock part and the method's on the same perturbed
# weights and compare what they compute:
#   - attention: MultiheadAttention vs PIDMultiheadAttention, a full-sequence forward with the causal mask and a key
#     padding mask (and the attributes the adapter reads, on a built layer);
#   - incremental: decoding one position at a time through incremental_state, a padding mask at one step, a beam
#     reorder (reorder_incremental_state): the outputs, and the buffers (prev_key / prev_value /
#     prev_key_padding_mask) bit for bit, a method's own cache slot reordered with them;
#   - layer: TransformerDecoderLayerBase vs PIDTransformerDecoderLayer, pre-norm with every scale option and post-norm,
#     full-sequence and incremental;
#   - decoder: transformer_lm vs transformer_lm_pid on its weights, logits with padding and an incremental decode with
#     a beam reorder, in both variants (and with gain warm-up at scale 0, fairseq's own attention inside the method
#     classes, bit for bit);
#   - build: transformer_lm and transformer_lm_pid from one seed (and every branch of build_model: character
#     embeddings, adaptive input tied to the adaptive softmax, decoder_layers_to_keep): the same parameters, bit for
#     bit.
# The method's parts run PID at vanishing gains (1e-30: the method classes compute every layer, the term is far below
# float32 rounding; at zero gains the adapter keeps fairseq's own layers, which would test nothing); the attention is
# compared to float32 rounding (SDPA scales inside, fairseq scales q first). A release that computes or builds
# differently fails its probe, whatever its text; one that only rewrites the text passes. Signatures are compared too
# (what the method classes call fairseq's methods with), and source text is left only where no probe can see the
# change, each with its reason: the options build_model reads and the attributes the layer's and the decoder's
# forwards read (an option a release adds changes nothing at its default, so no probe sees it; only the set of what
# the code reads shows that the method classes' copy would ignore it), and the numpy.compat names fairseq reads.

#: the behavioural probes by name ("attention", "incremental", "layer", "decoder", "build"):
#: :mod:`pid_plugins.fairseq.probes` registers them (``import pid_plugins.fairseq`` imports it; they build the method
#: classes, which import this module: hence a table, not an import)
PROBES: Dict[str, Callable[[], bool]] = {}


def _probe(name: str) -> bool:
    return PROBES[name]()


def _dataclass_field() -> bool:
    """Python's ``dataclasses._get_field`` (the one under the hook) is called as ``(cls, a_name, a_type, ...)``, refuses
    a field whose default is an instance of an unhashable (``eq=True``) dataclass, and takes the same default once its
    class has ``object.__hash__``, which is what the hook gives it: seen by calling it on a throwaway class."""
    import dataclasses

    import pid_plugins_fairseq_compat

    if not pid_plugins_fairseq_compat.target_holds():
        return False
    get_field = pid_plugins_fairseq_compat.python_get_field()
    later = list(inspect.signature(get_field).parameters.values())[3:]  # 3.12's default_kw_only

    @dataclasses.dataclass
    class Inner:
        x: int = 0

    class Owner:
        inner: Inner = Inner()

    args = (Owner, "inner", Inner, *(False for p in later if p.default is inspect.Parameter.empty))
    try:
        get_field(*args)
        return False  # taken while unhashable: Python no longer refuses it, and the hook would relax nothing
    except ValueError:
        pass
    Inner.__hash__ = object.__hash__  # type: ignore[assignment,method-assign]  (what the hook does to the class)
    field = get_field(*args)
    return isinstance(field, dataclasses.Field) and field.default is vars(Owner)["inner"]


def _numpy_compat() -> bool:
    # source text: which numpy.compat names fairseq reads is a property of the code on every path, and those paths
    # run only over data (the eos-break token blocks, the bucketed language-pair datasets); a probe would see only the
    # paths it builds data for, and only by replacing numpy's own `compat` while it runs. The names are matched as
    # written (np.compat.<name> or numpy.compat.<name>), so a reformatting passes; fairseq reading none is fine too
    from fairseq.data import language_pair_dataset, token_block_dataset

    names = set()
    for module in (token_block_dataset, language_pair_dataset):
        names.update(re.findall(r"\b(?:np|numpy)\.compat\.(\w+)", inspect.getsource(module)))
    return names <= {"long"}


class _Loaded(Exception):
    """Raised by the checkpoint probe's torch.load: the call reached the module global."""


def _checkpoint_torch() -> bool:
    """What fairseq's checkpoint loaders call: every one reaches ``torch.load`` through the module global ``torch`` of
    ``checkpoint_utils``, with the open file. Seen by behaviour: the global is swapped, for the probe's calls only, for
    a torch whose ``load`` raises, and each loader is called on an empty file."""
    import os
    import tempfile
    import types

    import torch
    from fairseq import checkpoint_utils

    current = checkpoint_utils.torch
    if not (isinstance(current, types.ModuleType) and current.__name__ == "torch"):
        return False  # the global that pid_plugins.fairseq.checkpoint replaces is torch (or that replacement)

    class Spy(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def load(f: Any, *args: Any, **kwargs: Any) -> Any:
            raise _Loaded(getattr(f, "name", f))

    fd, path = tempfile.mkstemp(suffix=".pt")
    os.close(fd)
    loaders = (checkpoint_utils.load_checkpoint_to_cpu, lambda p: checkpoint_utils.load_model_ensemble_and_task([p]),
               checkpoint_utils.load_ema_from_checkpoint)
    reached = []
    try:
        checkpoint_utils.torch = Spy("torch")
        for loader in loaders:
            try:
                loader(path)
            except _Loaded as loaded:
                reached.append(loaded.args[0] == path)
    finally:
        checkpoint_utils.torch = current
        os.remove(path)
    return reached == [True] * len(loaders)


#: the attributes of fairseq's ``MultiheadAttention`` the adapter reads (the method layer, convert's checks), set in
#: its ``__init__`` (the attention probe looks for them on a built layer)
MHA_ATTRIBUTES = frozenset({"q_proj", "k_proj", "v_proj", "out_proj", "dropout_module", "num_heads", "head_dim",
                            "bias_k", "add_zero_attn", "self_attention", "scaling"})


def _mha() -> bool:
    from fairseq.modules.multihead_attention import MultiheadAttention

    # the keywords the warm-up's stock path calls fairseq's forward with
    return (parameters(MultiheadAttention.forward)[:8] == ["self", "query", "key", "value", "key_padding_mask",
                                                           "incremental_state", "need_weights", "static_kv"]
            and "attn_mask" in parameters(MultiheadAttention.forward) and _probe("attention"))


def _input_buffer() -> bool:
    from fairseq.modules.multihead_attention import MultiheadAttention

    append = inspect.getattr_static(MultiheadAttention, "_append_prev_key_padding_mask")
    return (parameters(MultiheadAttention._get_input_buffer) == ["self", "incremental_state"]
            and parameters(MultiheadAttention._set_input_buffer) == ["self", "incremental_state", "buffer"]
            and isinstance(append, staticmethod)
            and parameters(append.__func__) == ["key_padding_mask", "prev_key_padding_mask", "batch_size", "src_len",
                                                "static_kv"]
            and _probe("incremental"))


#: what fairseq's ``TransformerDecoderLayerBase.forward`` reads: the method layer computes it again
DECODER_LAYER_READS = frozenset({
    "activation_dropout_module", "activation_fn", "attn_ln", "c_attn", "cross_self_attention", "dropout_module",
    "embed_dim", "encoder_attn", "encoder_attn_layer_norm", "fc1", "fc2", "ffn_layernorm", "final_layer_norm",
    "head_dim", "need_attn", "nh", "normalize_before", "onnx_trace", "residual_connection", "self_attn",
    "self_attn_layer_norm", "training", "w_resid"})
DECODER_LAYER_PARAMETERS = ["self", "x", "encoder_out", "encoder_padding_mask", "incremental_state",
                            "prev_self_attn_state", "prev_attn_state", "self_attn_mask", "self_attn_padding_mask",
                            "need_attn", "need_head_weights"]


def _decoder_layer() -> bool:
    from fairseq.modules.transformer_layer import TransformerDecoderLayerBase

    # source text: the attributes forward reads (an option a release adds is off at its default, where no probe sees
    # it; only the attributes forward reads show that the method layer's copy would ignore it)
    return (parameters(TransformerDecoderLayerBase.build_self_attention) == ["self", "embed_dim", "cfg",
                                                                             "add_bias_kv", "add_zero_attn"]
            and parameters(TransformerDecoderLayerBase.forward) == DECODER_LAYER_PARAMETERS
            and reads(TransformerDecoderLayerBase.forward) == DECODER_LAYER_READS
            and _probe("layer"))


#: what fairseq's ``TransformerDecoderBase.extract_features_scriptable`` reads: the method decoder computes it again
DECODER_READS = frozenset({
    "buffered_future_mask", "cross_self_attention", "dropout_module", "embed_positions", "embed_scale", "embed_tokens",
    "layer_norm", "layernorm_embedding", "layers", "num_layers", "padding_idx", "project_in_dim", "project_out_dim",
    "quant_noise"})
DECODER_PARAMETERS = ["self", "prev_output_tokens", "encoder_out", "incremental_state", "full_context_alignment",
                      "alignment_layer", "alignment_heads"]


def _decoder() -> bool:
    from fairseq.models.transformer import TransformerDecoder, TransformerDecoderBase

    # source text: the attributes extract_features_scriptable reads (as for the layer: an option a release adds is off
    # at its default, where no probe sees it)
    return (parameters(TransformerDecoderBase.extract_features_scriptable) == DECODER_PARAMETERS
            and reads(TransformerDecoderBase.extract_features_scriptable) == DECODER_READS
            and "extract_features_scriptable" not in vars(TransformerDecoder)
            and parameters(TransformerDecoder.build_decoder_layer) == ["self", "args", "no_encoder_attn"]
            and _probe("decoder"))


#: the options fairseq's ``TransformerLanguageModel.build_model`` reads: the method model's builds the same modules
BUILD_MODEL_ARGS = frozenset({
    "adaptive_input", "adaptive_input_cutoff", "adaptive_input_factor", "adaptive_softmax_cutoff",
    "adaptive_softmax_factor", "char_embedder_highway_layers", "character_embedding_dim", "character_embeddings",
    "character_filters", "decoder_embed_dim", "decoder_input_dim", "decoder_layers", "decoder_layers_to_keep",
    "decoder_output_dim", "max_target_positions", "quant_noise_pq", "quant_noise_pq_block_size",
    "tie_adaptive_weights"})


def _build_model() -> bool:
    from fairseq.models.transformer_lm import TransformerLanguageModel

    # source text: the options build_model reads (an option a release adds builds the same at its default, where no
    # probe sees it; only the options build_model reads show that transformer_lm_pid's copy would ignore it)
    build = TransformerLanguageModel.build_model
    return (reads(build, "args") == BUILD_MODEL_ARGS and reads(build, "cls") == {"build_embedding"}
            and _probe("build"))


#: the parameter group the param_group probe tags one parameter with
_PROBE_GROUP = "attention_params"


def _param_group() -> bool:
    """fairseq's ``--optimizer composite`` puts a parameter whose ``param_group`` attribute names a group in that group's
    optimizer, and an untagged one in ``default``: seen by building one on two parameters (on an instance whose
    optimizer tables are its own: fairseq keeps them on the class, shared by every instance)."""
    import torch
    from fairseq.optim.composite import FairseqCompositeOptimizer
    from omegaconf import OmegaConf

    plain, tagged = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    tagged.param_group = _PROBE_GROUP

    def group() -> Dict[str, Any]:
        return {"lr": [1.0], "optimizer": {"_name": "sgd", "momentum": 0.0, "weight_decay": 0.0},
                "lr_scheduler": {"_name": "fixed"}}

    cfg = OmegaConf.create({"_name": "composite", "groups": {"default": group(), _PROBE_GROUP: group()}})
    composite = FairseqCompositeOptimizer.__new__(FairseqCompositeOptimizer)
    composite.optimizers, composite.lr_schedulers = {}, {}
    composite.__init__(cfg, [plain, tagged])
    built = {name: [id(p) for g in optimizer.param_groups for p in g["params"]]
             for name, optimizer in composite.optimizers.items()}
    return built == {"default": [id(plain)], _PROBE_GROUP: [id(tagged)]}


# ------------------------------------------------------------------------------------------------- the internals
DATACLASS_FIELD = PythonInternal(
    "python", "dataclasses._get_field(cls, a_name, a_type, ...) refusing defaults whose class is unhashable",
    "importing fairseq 0.12.2 and hydra 1.0.7, whose config dataclasses have dataclass instances as defaults "
    "(pid_plugins_fairseq_compat)", "3.11 - 3.13", _dataclass_field)
NUMPY_COMPAT = Internal(
    ZOO, "fairseq reads numpy.compat.long (and no other numpy.compat name)",
    "providing numpy.compat.long under NumPy 2 (fairseq's eos-break datasets: fairseq-interactive, the hub "
    "interface's score/sample)", "0.12.2", _numpy_compat)
CHECKPOINT_TORCH = Internal(
    ZOO, "fairseq.checkpoint_utils.torch (the module global every checkpoint load calls torch.load on: the checkpoint "
    "probe)",
    "loading every fairseq checkpoint with weights_only=True whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says",
    "0.12.2", _checkpoint_torch)
MHA = Internal(
    ZOO, "MultiheadAttention: what its forward computes (the attention probe), its forward's keywords and the "
    "attributes the adapter reads (q_proj/k_proj/v_proj/out_proj, dropout_module, num_heads, head_dim, scaling, "
    "bias_k, add_zero_attn, self_attention)",
    "the method layer's q/k/v from the layer's own projections, and fairseq's own attention as the warm-up's stock "
    "path", "0.12.2", _mha)
INPUT_BUFFER = Internal(
    ZOO, "MultiheadAttention._get_input_buffer/_set_input_buffer, _append_prev_key_padding_mask and the buffer's "
    "layout (prev_key/prev_value (batch, heads, time, head_dim); reorder_incremental_state reorders every entry: the "
    "incremental probe)",
    "incremental decoding and beam search of the method layers (their keys, values and a method's own cache slot)",
    "0.12.2", _input_buffer)
DECODER_LAYER = Internal(
    ZOO, "TransformerDecoderLayerBase: what its forward computes (the layer probe), build_self_attention(embed_dim, "
    "cfg, add_bias_kv, add_zero_attn) called in __init__, and forward's parameters and the attributes it reads",
    "PIDTransformerDecoderLayer builds PIDMultiheadAttention and computes fairseq's layer again with the method",
    "0.12.2", _decoder_layer)
DECODER = Internal(
    ZOO, "TransformerDecoderBase.extract_features_scriptable: what it computes (the decoder probe), its parameters and "
    "the attributes it reads; TransformerDecoder.build_decoder_layer(args, no_encoder_attn)",
    "PIDTransformerDecoder builds the method layers and computes fairseq's decoder again with the method's state "
    "threaded through the layers", "0.12.2", _decoder)
BUILD_MODEL = Internal(
    ZOO, "TransformerLanguageModel.build_model: what it builds from a seed (the build probe), the options it reads "
    "and build_embedding",
    "transformer_lm_pid builds the same modules in the same order (a seed gives the stock model's weights)",
    "0.12.2", _build_model)
PARAM_GROUP = Internal(
    ZOO, "--optimizer composite reads each parameter's param_group attribute (the optimizer probe)",
    "keeping learnable method parameters in their own parameter group (attention_params)", "0.12.2", _param_group)

#: lowest part first (a probe builds the method classes above the part it checks, which require the parts below it:
#: checked in this order, a refusal names the lowest part whose check fails)
INTERNALS = (DATACLASS_FIELD, NUMPY_COMPAT, CHECKPOINT_TORCH, MHA, INPUT_BUFFER, DECODER_LAYER, DECODER, BUILD_MODEL,
             PARAM_GROUP)

#: what the method attention relies on
ATTENTION = (MHA, INPUT_BUFFER)
#: what a method language model relies on (built by fairseq, or converted), lowest part first
MODEL = (*ATTENTION, DECODER_LAYER, DECODER, BUILD_MODEL)


def require_all() -> None:
    """Check every internal now."""
    require(*INTERNALS)
