"""A VLM judge served by vLLM, priced from its architecture; only the server's host-side work per request
and step (``CostParams.serve_seq_step_s``) is fitted.

A request is prefilled once (its image's visual tokens and the prompt, compute-bound: 2 x parameters
FLOPs per token), then decoded one token a step; a decode step reads the weights once for every request
in flight, then each request's KV cache (memory-bound while the batch is small, as a judge's is). The
shapes are the judges' published configs, counted on transformers' real classes on the meta device
(:func:`count_params`; tests/test_judge.py recounts them). docs/scaling.md, "The cost model's terms".
"""

from __future__ import annotations

from dataclasses import dataclass

BF16 = 2


@dataclass(frozen=True)
class JudgeModel:
    """A VLM judge: its LM's attention shape, its parameters (LM + vision tower), how many pixels one
    visual token covers (patch x spatial merge), its prompt and its answer length."""

    name: str
    params: float  # counted by count_params
    layers: int
    kv_heads: int
    head_dim: int
    patch_px: int  # pixels per side one visual token covers (patch_size x spatial_merge_size)
    prompt_tokens: int  # the chat template, the system prompt and the instruction
    answer_tokens: int  # the answer's length (max_completion_tokens where a thinking judge uses them)
    source: str

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * BF16  # K and V, every layer, bf16

    def input_tokens(self, pixels: float) -> float:
        return pixels / self.patch_px**2 + self.prompt_tokens

    def prefill_s(self, requests: float, pixels: float, dev, mfu: float) -> float:
        """Seconds to prefill ``requests`` images on one ``dev`` (TP 1) at kernel efficiency ``mfu``."""
        return requests * self.input_tokens(pixels) * 2 * self.params / (dev.bf16_flops * mfu)

    def decode_step_s(
        self, in_flight: float, context: float, dev, mfu: float, bw_efficiency: float, seq_s: float = 0.0
    ) -> float:
        """One decode step with ``in_flight`` requests of ``context`` tokens each: the weights once, then
        every request's KV, or their matmuls, whichever is slower; and the server's host-side work per
        request (``seq_s``: scheduling, sampling, detokenizing)."""
        bw = dev.mem_bw * bw_efficiency
        memory = (self.params * BF16 + in_flight * context * self.kv_bytes_per_token) / bw
        return max(memory, in_flight * 2 * self.params / (dev.bf16_flops * mfu)) + in_flight * seq_s

    def tail_s(
        self,
        last: float,
        in_flight: float,
        pixels: float,
        dev,
        mfu: float,
        bw_efficiency: float,
        seq_s: float = 0.0,
    ) -> float:
        """The judge's time after the last ``last`` requests arrive, ``in_flight`` requests still decoding:
        their prefill, then a whole answer's steps (the earlier requests' prefills overlapped generation)."""
        context = self.input_tokens(pixels) + self.answer_tokens / 2  # the KV grows over the answer
        step = self.decode_step_s(in_flight, context, dev, mfu, bw_efficiency, seq_s)
        return self.prefill_s(last, pixels, dev, mfu) + self.answer_tokens * step


#: the judges' published configs (transformers class, its kwargs): their attention shapes and patches,
#: and what their parameter counts are counted from (:func:`count_params`)
CONFIGS = {
    "UnifiedReward-Think-qwen3vl-32b": (
        "Qwen3VLConfig",
        {
            "text_config": {
                "hidden_size": 5120,
                "intermediate_size": 25600,
                "num_hidden_layers": 64,
                "num_attention_heads": 64,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "vocab_size": 151936,
            },
            "vision_config": {
                "depth": 27,
                "hidden_size": 1152,
                "intermediate_size": 4304,
                "num_heads": 16,
                "out_hidden_size": 5120,
                "patch_size": 16,
                "spatial_merge_size": 2,
                "deepstack_visual_indexes": [8, 16, 24],
            },
            "tie_word_embeddings": False,
        },
    ),
    "GenRM-OCR Qwen2.5-VL-3B": (
        "Qwen2_5_VLConfig",
        {
            "text_config": {
                "hidden_size": 2048,
                "intermediate_size": 11008,
                "num_hidden_layers": 36,
                "num_attention_heads": 16,
                "num_key_value_heads": 2,
                "vocab_size": 151936,
                "tie_word_embeddings": True,
            },
            "vision_config": {
                "depth": 32,
                "hidden_size": 1280,
                "intermediate_size": 3420,
                "num_heads": 16,
                "out_hidden_size": 2048,
                "patch_size": 14,
                "spatial_merge_size": 2,
            },
            "tie_word_embeddings": True,
        },
    ),
}


def _shape(name: str) -> dict:
    """The attention shape and patch of judge ``name``, read off its config."""
    _, kwargs = CONFIGS[name]
    text, vision = kwargs["text_config"], kwargs["vision_config"]
    return {
        "layers": text["num_hidden_layers"],
        "kv_heads": text["num_key_value_heads"],
        "head_dim": text.get("head_dim", text["hidden_size"] // text["num_attention_heads"]),
        "patch_px": vision["patch_size"] * vision["spatial_merge_size"],
    }


#: MM-GRPO's reward (README.md:100 at d91797e): UnifiedReward-Think-qwen3vl-32b, fine-tuned from
#: Qwen3-VL-32B-Instruct (its config.json: LM 64 layers, 8 KV heads of 128; vision patch 16, merge 2),
#: served by vLLM on one H800 (TP 1 assumed: the script does not say), asked for OCR at temperature 0 with
#: max_completion_tokens 256 (gerl/utils/reward_score/vllm.py:57-66) -- a thinking judge's answer uses them
UNIFIED_REWARD_THINK_32B = JudgeModel(
    name="UnifiedReward-Think-qwen3vl-32b",
    params=33.36e9,
    **_shape("UnifiedReward-Think-qwen3vl-32b"),
    prompt_tokens=40,
    answer_tokens=256,
    source="leibniz-csi/mm_grpo gerl/utils/reward_score/vllm.py:57-66 (d91797e); Qwen3-VL-32B config",
)

#: veRL-Omni's SD3.5 judge (run_sd35_medium_ocr_lora.sh :97): GenRM-OCR on Qwen2.5-VL-3B-Instruct (LM 36
#: layers, 2 KV heads of 128; vision patch 14, merge 2) at TP 1, temperature 0.7, max_tokens 4096
#: (genrm_ocr.py:38); an OCR answer is a short transcription (answer_tokens: 24) unless it runs on
QWEN25_VL_3B_OCR = JudgeModel(
    name="GenRM-OCR Qwen2.5-VL-3B",
    params=3.755e9,
    **_shape("GenRM-OCR Qwen2.5-VL-3B"),
    prompt_tokens=40,
    answer_tokens=24,
    source="verl-project/verl-omni verl_omni/utils/reward_score/genrm_ocr.py:34-38; Qwen2.5-VL-3B config",
)


def count_params(name: str) -> float:
    """The judge's parameters, counted on transformers' real class on the meta device (seconds)."""
    import torch
    import transformers

    cls_name, kwargs = CONFIGS[name]
    config = getattr(transformers, cls_name)(**kwargs)
    model_cls = {
        "Qwen3VLConfig": transformers.Qwen3VLForConditionalGeneration,
        "Qwen2_5_VLConfig": transformers.Qwen2_5_VLForConditionalGeneration,
    }[cls_name]
    with torch.device("meta"):
        model = model_cls(config)
    return float(sum(p.numel() for p in model.parameters()))
