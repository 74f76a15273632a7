"""A transformers stand-in for upstream Twinkle's ``vLLMSampler`` (docs/upstream.md).

Upstream's RL cookbook samples with vLLM through Ray; neither is needed here. A ported script
imports this module's sampler in its place, with upstream's call forms and data conventions::

    from twinkle_megatron.sampling import TransformersSampler as vLLMSampler
    from twinkle_megatron.sampling import CheckpointEngineManager

- :class:`TransformersSampler` ``(model_id, engine_args=None, device_mesh=None)``: a whole
  transformers model in this process, loaded from ``model_id`` (a local folder, or ``hf://`` /
  ``ms://`` in the local cache, as ``MegatronModel``). ``sample(inputs, SamplingParams(...))``
  returns one :class:`SampleResponse` per input, with upstream's field names:

  - ``max_tokens=0, prompt_logprobs=k``: the teacher's top-k log-probs of each prompt position,
    vLLM's convention: ``topk_prompt_logprobs[0]`` is None, ``topk_prompt_logprobs[t]`` is the
    distribution of token t given the tokens before it, ``[(token_id, logprob), ...]`` in
    descending order, raw ``log_softmax`` of the logits (no temperature); ``prompt_logprobs[t]`` is
    token t's own log-prob. One forward per sequence, unpadded (a row's numbers never depend on
    the other rows of the call).
  - ``max_tokens=n`` (default 16, as vLLM), ``num_samples``, ``temperature`` (0: greedy),
    ``top_k``, ``top_p``, ``seed``, ``stop`` (token ids), ``logprobs``: completions decoded with a
    KV cache; a row stops after an end-of-sequence id of the model's generation config or a
    ``stop`` id (kept, ``stop_reason='stop'``), else after ``max_tokens`` (``'length'``).
    ``sequence.logprobs``: per token ``[(id, logprob)]`` (``logprobs=1``: the sampled token) or
    the top ``logprobs`` ids; of the distribution sampled from (``engine_args['logprobs_mode']``
    ``'processed_logprobs'``, vLLM's default: after temperature / top-k / top-p) or of the raw
    logits (``'raw_logprobs'``).

- :class:`CheckpointEngineManager` ``(model=, sampler=)``: ``sync_weights(merge_and_sync=...)``
  copies a live ``MegatronModel``'s weights into the sampler (:func:`twinkle_megatron.weight_sync.sync`).

The ``SamplingParams`` given may be this module's or upstream's (``twinkle.data_format``; any
object with its fields), or a dict of them.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .upstream import refuse_unknown
from .weight_sync.sampler import CountedStream, HFSampler, sync

__all__ = ["CheckpointEngineManager", "SampleResponse", "SampledSequence", "SamplingParams", "TransformersSampler"]

# vLLM's default cap on logprobs / prompt_logprobs per request (its engine argument max_logprobs)
DEFAULT_MAX_LOGPROBS = 20
# vLLM's default max_tokens when a request gives none
DEFAULT_MAX_TOKENS = 16
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
# engine_args this sampler reads (the rest of vLLM's are refused: see TransformersSampler)
ENGINE_ARGS = ("dtype", "seed", "max_model_len", "max_logprobs", "logprobs_mode", "gpu_memory_utilization",
               "tensor_parallel_size", "enable_lora", "max_lora_rank", "max_loras", "enable_tower_connector_lora",
               "enable_prefix_caching")


@dataclasses.dataclass
class SamplingParams:
    """Upstream Twinkle's sampling parameters (``twinkle.data_format.SamplingParams``), the same
    fields and defaults. ``stop``: token ids (a string stop is refused by the sampler)."""
    max_tokens: Optional[int] = None
    seed: Optional[int] = None
    stop: Union[str, Sequence[str], Sequence[int], None] = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    num_samples: int = 1

    def __post_init__(self):
        def bad(name, want):
            raise ValueError(f"SamplingParams.{name} must be {want}, got {getattr(self, name)!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad("temperature", "a number >= 0")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1]")
        if not _is_int(self.top_k) or (self.top_k != -1 and self.top_k < 1):
            bad("top_k", "-1 or an int >= 1")
        for name in ("logprobs", "prompt_logprobs", "max_tokens", "seed"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                bad(name, "None or an int >= 0")
        if not _is_int(self.num_samples) or self.num_samples < 1:
            bad("num_samples", "an int >= 1")
        if isinstance(self.repetition_penalty, bool) or not isinstance(self.repetition_penalty, (int, float)) \
                or self.repetition_penalty <= 0:
            bad("repetition_penalty", "a number > 0")

    @classmethod
    def coerce(cls, params) -> "SamplingParams":
        """This class from None (the defaults), a dict of its fields (upstream's ``max_new_tokens``
        read as ``max_tokens``), or an object with its fields (upstream's ``SamplingParams``).
        Unknown dict keys are a TypeError."""
        if params is None:
            return cls()
        if isinstance(params, cls):
            return params
        names = [f.name for f in dataclasses.fields(cls)]
        if isinstance(params, dict):
            d = dict(params)
            if "max_new_tokens" in d:
                if "max_tokens" in d:
                    raise TypeError("sampling_params: give max_tokens or max_new_tokens, not both")
                d["max_tokens"] = d.pop("max_new_tokens")
            unknown = sorted(k for k in d if k not in names)
            if unknown:
                raise TypeError(f"sampling_params: unknown field(s) {unknown} (SamplingParams has {names})")
            return cls(**d)
        missing = [n for n in names if not hasattr(params, n)]
        if missing:
            raise TypeError(f"sampling_params must be a SamplingParams (this package's or upstream's) or a dict, "
                            f"got {type(params).__name__} without {missing}")
        return cls(**{n: getattr(params, n) for n in names})


@dataclasses.dataclass
class SampledSequence:
    """One completion (upstream's ``SampledSequence``): ``tokens`` the generated ids, ``logprobs``
    per token ``[(id, logprob), ...]`` (None unless requested), ``decoded`` its text,
    ``new_input_feature`` the prompt's input feature with the completion appended (the template's
    ``concat_input_feature``; for ``max_tokens=0`` the prompt's feature itself)."""
    stop_reason: str
    tokens: List[int]
    logprobs: Optional[List[List[Tuple[int, float]]]] = None
    decoded: Optional[str] = None
    new_input_feature: Optional[Dict[str, Any]] = None
    routed_experts: Optional[Any] = None


@dataclasses.dataclass
class SampleResponse:
    """What one input gives (upstream's ``SampleResponse``): ``num_samples`` sequences, the prompt's
    ids and, with ``prompt_logprobs=k``, its per-position log-probs (see the module docstring)."""
    sequences: List[SampledSequence]
    prompt_token_ids: Optional[List[int]] = None
    prompt_logprobs: Optional[List[Optional[float]]] = None
    topk_prompt_logprobs: Optional[List[Optional[List[Tuple[int, float]]]]] = None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _to_list(obj):
    """numpy / torch values of an input feature as Python lists and numbers (upstream converts
    what it returns the same way)."""
    if hasattr(obj, "tolist") and not isinstance(obj, (str, bytes)):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: _to_list(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_list(v) for v in obj) if isinstance(obj, tuple) else [_to_list(v) for v in obj]
    return obj


class TransformersSampler:
    """Upstream's ``vLLMSampler`` on transformers, in this process (see the module docstring).

    ``model_id``: a local model folder (or ``hf://`` / ``ms://`` found in the local cache); a folder
    without weights files gives a model with random weights that samples only after a
    :class:`CheckpointEngineManager` sync (``sample`` before it is a RuntimeError).
    ``engine_args`` (vLLM's engine arguments; each one read here does what it does in vLLM, the
    others are a TypeError naming them):

    - ``dtype``: ``'auto'`` (default: the config's ``torch_dtype``, float32 when it has none) or a
      torch dtype name;
    - ``seed``: the sampler's generator seed (default ``42 + RANK``, as upstream's engine);
    - ``max_model_len``: a prompt longer than this is a ValueError, completions stop at it;
    - ``max_logprobs`` (default 20): ``logprobs`` / ``prompt_logprobs`` above it are a ValueError;
    - ``logprobs_mode``: ``'processed_logprobs'`` (default) or ``'raw_logprobs'``;
    - ``enable_lora`` / ``max_lora_rank`` / ``max_loras``: whether the sampler takes an adapter
      synced from the trainer (:class:`CheckpointEngineManager` with ``merge_and_sync=False``),
      its largest rank, and how many (this sampler holds one);
    - accepted with no effect, because they size what vLLM preallocates on a GPU and a transformers
      model here preallocates nothing: ``gpu_memory_utilization``, ``enable_prefix_caching``
      (each call prefills anew; :meth:`reset_prefix_cache` does nothing),
      ``enable_tower_connector_lora`` (vision-tower LoRA of multimodal models: the text decoder is
      what is sampled here);
    - ``tensor_parallel_size``: 1 only (one whole replica per process).

    ``device_mesh``: accepted for upstream's signature; each process holds a whole replica and
    samples the inputs it is given (upstream's Ray workers slice a call's inputs by data-parallel
    rank; under torchrun the script's DataLoader has already given each rank its share). A mesh
    with tensor, pipeline or context parallelism is a ValueError. Ray's ``remote_group`` is a
    TypeError (as on ``MegatronModel``).
    """

    def __init__(self, model_id: str, engine_args: Optional[Dict[str, Any]] = None, device_mesh=None, **kwargs):
        refuse_unknown("TransformersSampler", kwargs)
        args = dict(engine_args or {})
        unknown = sorted(k for k in args if k not in ENGINE_ARGS)
        if unknown:
            raise TypeError(f"TransformersSampler: engine_args {unknown} have no meaning for a transformers "
                            f"sampler (it reads {sorted(ENGINE_ARGS)})")
        if args.get("tensor_parallel_size", 1) != 1:
            raise ValueError(f"engine_args['tensor_parallel_size']={args['tensor_parallel_size']}: the "
                             "transformers sampler holds one whole replica per process (1 only)")
        if device_mesh is not None:
            split = {k: getattr(device_mesh, k, 1) for k in ("tp_size", "pp_size", "cp_size")}
            if any(v not in (1, None) for v in split.values()):
                raise ValueError(f"device_mesh: the transformers sampler holds one whole replica per process; "
                                 f"a mesh that splits the model ({split}) has no meaning for it")
        self.logprobs_mode = args.get("logprobs_mode", "processed_logprobs")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"engine_args['logprobs_mode'] must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        self.max_logprobs = args.get("max_logprobs", DEFAULT_MAX_LOGPROBS)
        self.max_model_len = args.get("max_model_len")
        for name in ("max_logprobs", "max_model_len", "max_lora_rank", "max_loras"):
            value = args.get(name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"engine_args[{name!r}] must be an int >= 1, got {value!r}")
        self.enable_lora = bool(args.get("enable_lora", False))
        self.max_lora_rank = args.get("max_lora_rank")
        if args.get("max_loras", 1) != 1:
            raise ValueError(f"engine_args['max_loras']={args['max_loras']}: this sampler holds one synced adapter")
        seed = args.get("seed")
        if seed is None:
            seed = 42 + int(os.environ.get("RANK", "0"))
        self.generator = torch.Generator().manual_seed(seed)

        import transformers
        from .hub import resolve_model_id
        self.model_id = model_id
        self.model_dir = resolve_model_id(model_id)
        config = transformers.AutoConfig.from_pretrained(self.model_dir)
        dtype = args.get("dtype", "auto")
        if dtype == "auto":
            dtype = getattr(config, "torch_dtype", None) or torch.float32
        if isinstance(dtype, str):
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"engine_args['dtype']={dtype!r} is not a torch dtype name")
            dtype = getattr(torch, dtype)
        self.dtype = dtype
        has_weights = any(f.endswith((".safetensors", ".bin")) for f in os.listdir(self.model_dir))
        if has_weights:
            hf = transformers.AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype,
                                                                   attn_implementation="sdpa")
        else:
            # a folder without weights (a config a trainer initialises from its seed): random
            # weights, refused by sample() until a CheckpointEngineManager sync has filled them
            hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        self.replica = HFSampler(hf)          # weight_sync's replica: what sync_weights refreshes
        self.replica.base_synced = has_weights
        self.template = None
        self._tokenizer = None
        eos = hf.generation_config.eos_token_id if hf.generation_config is not None else None
        if eos is None:
            eos = getattr(_text_config(config), "eos_token_id", None)
        self.eos_token_ids = set([eos] if _is_int(eos) else list(eos or []))

    @property
    def model(self) -> torch.nn.Module:
        """The transformers (after an adapter sync, peft) model that samples."""
        return self.replica.model

    # ---- upstream's template interface -------------------------------------------------------

    def set_template(self, template_cls, **kwargs):
        """Upstream's ``set_template``: ``template_cls`` an upstream ``Template`` class (built with
        ``kwargs``, ``model_id`` defaulting to this sampler's), an instance of one, or its name in
        ``twinkle.template`` (needs twinkle-kit). The template encodes ``messages`` inputs, maps
        prompt ids (``get_vllm_input_ids``), appends completions (``concat_input_feature``) and
        decodes them."""
        if isinstance(template_cls, str):
            try:
                import twinkle.template as upstream_templates
            except ImportError as e:
                raise ValueError(f"set_template({template_cls!r}): a template named by string is looked up in "
                                 "upstream's twinkle.template (pip install twinkle-kit); pass the class") from e
            if not hasattr(upstream_templates, template_cls):
                raise ValueError(f"set_template: twinkle.template has no {template_cls!r}")
            template_cls = getattr(upstream_templates, template_cls)
        if isinstance(template_cls, type):
            kwargs.setdefault("model_id", self.model_id)
            template = template_cls(**kwargs)
        else:
            if kwargs:
                raise TypeError(f"set_template: keywords {sorted(kwargs)} given with a template instance")
            template = template_cls
        for name in ("encode", "decode"):
            if not callable(getattr(template, name, None)):
                raise TypeError(f"set_template: {type(template).__name__} has no {name}() (an upstream Template "
                                "is expected)")
        self.template = template
        return template

    def reset_prefix_cache(self):
        """vLLM's prefix cache: there is none here (each call prefills its prompts anew)."""

    # ---- sampling ----------------------------------------------------------------------------

    def sample(self, inputs, sampling_params=None, adapter_name: str = "", adapter_path: Optional[str] = None, *,
               return_encoded: bool = False, use_base_model: bool = False) -> List[SampleResponse]:
        """One :class:`SampleResponse` per input (see the module docstring).

        ``inputs``: one input or a list; each an input feature (a dict with ``input_ids``, as
        upstream's Template / DataLoader give them; numpy or torch values are fine) or a trajectory
        (a dict with ``messages``, encoded by the template: with a generation prompt unless
        ``max_tokens=0``). ``sampling_params``: :class:`SamplingParams`, upstream's, or a dict.
        ``use_base_model=True`` samples without the synced adapter. ``adapter_name`` must be ''
        (the one synced adapter) and ``adapter_path`` None (load a saved adapter into the trainer
        and sync it instead); ``return_encoded`` is upstream's no-op and is accepted as such."""
        if adapter_name not in ("", None):
            raise ValueError(f"sample(adapter_name={adapter_name!r}): this sampler holds one synced adapter; "
                             "leave adapter_name empty")
        if adapter_path is not None:
            raise ValueError("sample(adapter_path=...): load the adapter into the trainer and sync it "
                             "(CheckpointEngineManager); the sampler does not read adapter folders")
        if not self.replica.base_synced:
            raise RuntimeError(f"sample: {self.model_dir} has no weights and none were synced yet "
                               "(CheckpointEngineManager(model=, sampler=).sync_weights() first)")
        params = SamplingParams.coerce(sampling_params)
        self._check(params)
        items = [inputs] if isinstance(inputs, dict) else list(inputs)
        if not items:
            raise ValueError("sample: inputs is empty")
        logprobs_only = params.max_tokens == 0
        out = []
        with self._adapter(disabled=use_base_model):
            for i, item in enumerate(items):
                if not isinstance(item, dict):
                    raise TypeError(f"inputs[{i}] must be a dict (an input feature or a trajectory), got "
                                    f"{type(item).__name__}")
                feat = self._encode(item, add_generation_prompt=not logprobs_only)
                ids = feat["input_ids"]
                prompt = list(self.template.get_vllm_input_ids(ids)) if hasattr(self.template, "get_vllm_input_ids") \
                    else list(ids)
                if not prompt:
                    raise ValueError(f"inputs[{i}]: empty prompt")
                if self.max_model_len is not None and len(prompt) > self.max_model_len:
                    raise ValueError(f"inputs[{i}]: prompt of {len(prompt)} tokens is longer than "
                                     f"engine_args['max_model_len']={self.max_model_len}")
                out.append(self._sample_one(feat, prompt, params, logprobs_only))
        return out

    def _check(self, p: SamplingParams):
        if p.repetition_penalty != 1.0:
            raise ValueError("SamplingParams.repetition_penalty: not implemented by the transformers sampler (1.0 only)")
        stop = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
        if any(not _is_int(s) for s in stop):
            raise ValueError(f"SamplingParams.stop={p.stop!r}: the transformers sampler stops on token ids only "
                             "(give the ids of the stop string)")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(p, name)
            if k is not None and k > self.max_logprobs:
                raise ValueError(f"SamplingParams.{name}={k} exceeds engine_args['max_logprobs']={self.max_logprobs}")

    def _encode(self, item: dict, add_generation_prompt: bool) -> dict:
        if "input_ids" in item:
            return _to_list(item)
        if "messages" not in item:
            raise ValueError(f"an input needs 'input_ids' (an input feature) or 'messages' (a trajectory); got keys "
                             f"{sorted(item)}")
        if self.template is None:
            raise ValueError("sample: trajectory inputs ('messages') need set_template first")
        return _to_list(self.template.encode(item, add_generation_prompt=add_generation_prompt))

    @torch.no_grad()
    def _logits(self, ids: torch.Tensor, cache=None, mask=None, pos=None) -> torch.Tensor:
        device = next(self.model.parameters()).device
        kw = dict(input_ids=ids.to(device), use_cache=cache is not None)
        if cache is not None:
            kw.update(past_key_values=cache, attention_mask=mask.to(device), position_ids=pos.to(device))
        logits = self.model(**kw).logits
        # fp32 at least (a bf16 model's logits are upcast, as vLLM's sampler does); fp64 kept
        return logits.to(torch.promote_types(logits.dtype, torch.float32)).cpu()

    def _sample_one(self, feat: dict, prompt: List[int], p: SamplingParams, logprobs_only: bool) -> SampleResponse:
        response = SampleResponse(sequences=[], prompt_token_ids=list(prompt))
        if p.prompt_logprobs:
            # one unpadded forward of the prompt: position t - 1's logits give token t's distribution
            lp = torch.log_softmax(self._logits(torch.tensor([prompt]))[0], -1)
            vals, idx = lp[:-1].topk(p.prompt_logprobs, -1)
            own = lp[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
            response.prompt_logprobs = [None] + own.tolist()
            response.topk_prompt_logprobs = [None] + [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
        if logprobs_only:
            response.sequences = [SampledSequence(stop_reason="length", tokens=[], new_input_feature=copy.deepcopy(feat))
                                  for _ in range(p.num_samples)]
            return response
        rows = self._generate(prompt, p)
        for tokens, logprobs, reason in rows:
            if hasattr(self.template, "concat_input_feature"):
                new = _to_list(self.template.concat_input_feature(feat, tokens))
            else:
                new = dict(copy.deepcopy(feat), input_ids=list(prompt) + tokens)
            response.sequences.append(SampledSequence(
                stop_reason=reason, tokens=tokens, logprobs=logprobs, new_input_feature=new,
                decoded=self.template.decode(tokens) if self.template is not None else self._decode(tokens)))
        return response

    def _decode(self, tokens: List[int]) -> Optional[str]:
        if self._tokenizer is None:
            import transformers
            try:
                self._tokenizer = transformers.AutoTokenizer.from_pretrained(self.model_dir)
            except (OSError, ValueError):
                self._tokenizer = False       # the folder has no tokenizer: no text
        return self._tokenizer.decode(tokens) if self._tokenizer else None

    @torch.no_grad()
    def _generate(self, prompt: List[int], p: SamplingParams):
        """``num_samples`` completions of one prompt, decoded together as one ``[n, len]`` batch
        (the rows share the prompt: no padding) with a KV cache; one ``torch.multinomial`` draw
        per step for all rows from the sampler's generator (or ``SamplingParams.seed``'s)."""
        from transformers import DynamicCache
        n = p.num_samples
        max_tokens = DEFAULT_MAX_TOKENS if p.max_tokens is None else p.max_tokens
        if self.max_model_len is not None:
            max_tokens = min(max_tokens, self.max_model_len - len(prompt))
        generator = self.generator if p.seed is None else torch.Generator().manual_seed(p.seed)
        stops = self.eos_token_ids | set([p.stop] if isinstance(p.stop, int) else list(p.stop or []))
        ids = torch.tensor([prompt] * n)
        mask = torch.ones_like(ids)
        pos = torch.arange(len(prompt)).expand(n, -1)
        cache = DynamicCache(config=_text_config(self.model.config))
        tokens = [[] for _ in range(n)]
        logps = [[] if p.logprobs is not None else None for _ in range(n)]
        reasons = ["length"] * n
        done = [False] * n
        vocab = _text_config(self.model.config).vocab_size
        for _ in range(max(max_tokens, 0)):
            logits = self._logits(ids, cache, mask, pos)[:, -1, :vocab]
            processed = _process(logits, p)
            if p.temperature == 0:
                picked = processed.argmax(-1)
            else:
                picked = torch.multinomial(torch.softmax(processed, -1), 1, generator=generator)[:, 0]
            if p.logprobs is not None:
                lp = torch.log_softmax(processed if self.logprobs_mode == "processed_logprobs" else logits, -1)
            for i, t in enumerate(picked.tolist()):
                if done[i]:
                    continue
                tokens[i].append(t)
                if p.logprobs is not None:
                    if p.logprobs == 1:
                        logps[i].append([(t, lp[i, t].item())])
                    else:
                        v, j = lp[i].topk(p.logprobs) if p.logprobs else (lp[i, :0], lp[i, :0].long())
                        logps[i].append(list(zip(j.tolist(), v.tolist())))
                if t in stops:
                    done[i], reasons[i] = True, "stop"
            if all(done):
                break
            ids = picked[:, None]
            mask = torch.cat([mask, mask.new_ones((n, 1))], 1)
            pos = pos[:, -1:] + 1
        return list(zip(tokens, logps, reasons))

    # ---- weights -------------------------------------------------------------------------------

    def _adapter(self, disabled: bool):
        """A context: the synced adapter disabled (``use_base_model``) or as it is."""
        import contextlib
        if disabled and self.replica.adapter_name is not None:
            return self.model.disable_adapter()
        return contextlib.nullcontext()


def _process(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Logits [n, V] fp32 after temperature, top-k and top-p (vLLM's order): the distribution the
    sampler draws from is ``softmax`` of the result (-inf outside the kept ids)."""
    out = logits / p.temperature if p.temperature > 0 else logits.clone()
    if p.top_k > 0 and p.top_k < out.shape[-1]:
        kth = out.topk(p.top_k, -1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = out.sort(-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # drop an id when the mass before it already reaches top_p (the top id is always kept)
        drop = probs.cumsum(-1) - probs >= p.top_p
        out = out.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return out


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


# a vision-language checkpoint's decoder names (what the trainer streams for e.g. Qwen3.5) and
# the text model's that the sampler holds (transformers' *ForCausalLM of the same config)
VL_DECODER_PREFIX, TEXT_DECODER_PREFIX = "model.language_model.", "model."


class CheckpointEngineManager:
    """Upstream's ``CheckpointEngineManager(model=, sampler=)``: :meth:`sync_weights` copies the
    live ``MegatronModel``'s weights into the :class:`TransformersSampler` (upstream streams them
    over NCCL into vLLM; here :func:`twinkle_megatron.weight_sync.sync` copies them in process).
    Collective: every rank of the trainer calls it, each with its own sampler (one whole replica
    per process; ``get_hf_state_dict``'s "replicas" receivers). ``platform`` (upstream's choice of
    NCCL / HCCL) has no meaning for an in-process copy and is refused."""

    def __init__(self, model, sampler: TransformersSampler, **kwargs):
        refuse_unknown("CheckpointEngineManager", kwargs)
        if not isinstance(sampler, TransformersSampler):
            raise TypeError(f"sampler must be a twinkle_megatron.sampling.TransformersSampler, got "
                            f"{type(sampler).__name__}")
        if not callable(getattr(model, "get_hf_state_dict", None)):
            raise TypeError(f"model must be a twinkle_megatron.MegatronModel, got {type(model).__name__}")
        self.model, self.sampler = model, sampler
        self.base_sync_done = False

    def _adapter(self) -> Optional[str]:
        names = list(self.model.adapters)
        if len(names) > 1:
            raise ValueError(f"sync_weights: the model has {len(names)} adapters ({names}); the sampler holds one "
                             "(upstream's manager syncs a single-adapter model)")
        return names[0] if names else None

    def sync_weights(self, merge_and_sync: bool = True) -> dict:
        """Copy the trainer's current weights into the sampler (after each optimizer step).

        - a model without adapters: its full weights, every call;
        - an adapter, ``merge_and_sync=True``: the weights with the adapter merged, every call;
        - an adapter, ``merge_and_sync=False``: the base weights and the adapter on the first
          call, the adapter alone afterwards; the sampler becomes a peft model carrying it (needs
          ``engine_args={'enable_lora': True}``, and ``max_lora_rank`` >= its rank when given, as
          vLLM's LoRA does).

        Returns :func:`~twinkle_megatron.weight_sync.sync`'s ``{"tensors", "bytes", "seconds",
        "full"}``. A vision-language checkpoint's decoder names (``model.language_model.*``) go
        into the sampler's text model (``model.*``)."""
        if not isinstance(merge_and_sync, bool):
            raise TypeError(f"merge_and_sync must be a bool, got {merge_and_sync!r}")
        name, sampler = self._adapter(), self.sampler
        if name is None or merge_and_sync:
            if sampler.replica.adapter_name is not None:
                raise ValueError("sync_weights(merge_and_sync=True) after merge_and_sync=False: the sampler holds "
                                 "the adapter unmerged; keep one mode for a run")
            stream = self.model.get_hf_state_dict(adapter_name=name, merge_lora=name is not None,
                                                  dtype=sampler.dtype, receivers="replicas")
            start = time.perf_counter()
            counted = CountedStream(stream)
            count = sampler.replica.refresh(_rename(counted, sampler.model))
            self.base_sync_done = True
            return {"tensors": count, "bytes": counted.nbytes, "seconds": time.perf_counter() - start, "full": True}
        if not sampler.enable_lora:
            raise ValueError("sync_weights(merge_and_sync=False) syncs the adapter unmerged: the sampler needs "
                             "engine_args={'enable_lora': True} (or sync with merge_and_sync=True)")
        if sampler.replica.adapter_name is None:
            self._wrap(name)
        elif sampler.replica.adapter_name != name:
            raise ValueError(f"sync_weights: the sampler holds adapter {sampler.replica.adapter_name!r}, the model "
                             f"trains {name!r}")
        out = sync(self.model, _Renaming(sampler.replica), adapter_name=name, full=not self.base_sync_done,
                   receivers="replicas", dtype=sampler.dtype)
        self.base_sync_done = True
        return out

    def _wrap(self, name: str):
        """The sampler's model as a peft model carrying adapter ``name`` with the trainer's config
        (the modules it adapts, in the sampler's names); its base weights count as unsynced."""
        import peft
        from .lora import adapter_config_dict
        fields = {k: v for k, v in adapter_config_dict(self.model.adapters[name], None).items()
                  if k not in ("peft_type", "auto_mapping", "revision", "base_model_name_or_path")}
        rank = fields.get("r")
        limit = self.sampler.max_lora_rank
        if limit is not None and rank is not None and rank > limit:
            raise ValueError(f"sync_weights: adapter {name!r} has rank {rank} > engine_args['max_lora_rank']={limit}")
        targets = fields.get("target_modules")
        if isinstance(targets, (list, tuple)):
            fields["target_modules"] = [_text_name(t, self.sampler.model) for t in targets]
        wrapped = peft.get_peft_model(self.sampler.model, peft.LoraConfig(**fields), adapter_name=name)
        self.sampler.replica = HFSampler(wrapped, adapter_name=name)


def _text_name(name: str, model) -> str:
    """A vision-language decoder name as the sampler's text model names it (others unchanged)."""
    if VL_DECODER_PREFIX in name and not _has_vl_names(model):
        return name.replace(VL_DECODER_PREFIX, TEXT_DECODER_PREFIX, 1)
    return name


def _has_vl_names(model) -> bool:
    return any(VL_DECODER_PREFIX in n for n, _ in model.named_parameters())


def _rename(stream, model):
    vl = _has_vl_names(model)
    for name, tensor in stream:
        yield (name if vl or VL_DECODER_PREFIX not in name else name.replace(VL_DECODER_PREFIX, TEXT_DECODER_PREFIX, 1),
               tensor)


class _Renaming:
    """``replica`` for weight_sync.sync, with the stream's names mapped to the replica's."""

    def __init__(self, replica: HFSampler):
        self.replica = replica

    @property
    def base_synced(self):
        return self.replica.base_synced

    def refresh(self, stream) -> int:
        return self.replica.refresh(_rename(stream, self.replica.model))
