"""Qwen3-VL (``Qwen3VLForConditionalGeneration``).

Its inputs are Qwen2-VL's, hence a subclass of ``Qwen2VLBackbone``: each image's flattened patches with its grid,
merged image tokens written over the ``<|image_pad|>`` tokens, M-RoPE positions from the model's own
``get_rope_index`` (3 rows, t/h/w; the sections are interleaved inside transformers' rotary embedding, not in the
ids; transformers' ``generate`` prepends a 4th, text row that the text model reads only to build a causal mask
where no attention mask is given, and the wrapper always gives one).

Its own is DeepStack: the ViT also merges the hidden states of some of its blocks (``deepstack_visual_indexes``)
into features of the LLM's width, and ``Qwen3VLTextModel`` adds the k-th of them to the hidden states at the image
tokens after its k-th decoder layer (``visual_pos_masks``, ``deepstack_visual_embeds``). The causal LM run on input
embeddings alone drops them (on the tiny model its logits then differ from transformers' by 0.43 at a scale of
0.50), so here ``positions`` gives a ``DeepstackPositions`` -- the position ids, the image-token mask and the
deepstack features -- that ``insert_prompts`` moves with the prompts (the prompt slots are no image tokens), and
``logits`` / ``generate`` call the text model with it and then ``lm_head``. Generation is the wrapper's own greedy
loop with the KV cache: the prompt's pass carries the deepstack features, the decoding steps (text tokens) none, as
in transformers' ``generate``.

The tower runs once per batch: ``vision`` (inside ``input_embeddings``) keeps the deepstack features of the images
it saw, and ``positions`` takes them from there when its batch has the same images, which is how methods call the
two (``mcit.methods.instruction``); for other images it runs the tower itself. (The deepstack features do not
depend on the main merger, ``projector_path``, which a method may train: kept features stay valid.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from mcit.core.registry import BACKBONES
from mcit.data.types import Batch
from mcit.models.qwen2_5_vl import qwen_image_processor, qwen_tokenizer
from mcit.models.qwen2_vl import ImageTokenProcessor, Qwen2VLBackbone

# Qwen/Qwen3-VL-8B-Instruct's chat template (its chat_template.json; the hub is not reachable here): the text of
# Qwen/Qwen3-VL-8B-Instruct-GGUF's tokenizer.chat_template, byte for byte as a public project pins it (5292 bytes,
# sha256 3636d0f0...a489e4; tests/unit/test_family_qwen3_vl.py checks both). No default system prompt: an image +
# text user turn renders as "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{text}<|im_end|>\n".
QWEN3_VL_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are \
provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments \
within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": \
<args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' }}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content_item in message.content %}
                {%- if 'text' in content_item %}
                    {{- content_item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and message.content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


@dataclass
class DeepstackPositions:
    """What Qwen3-VL's text model needs beyond input embeddings: M-RoPE position ids (3, B, L), which tokens are
    image tokens (B, L) and the deepstack features of those tokens, one (n_image_tokens, d) per early decoder layer
    in the mask's row-major order (None, None where the batch has no image)."""

    position_ids: torch.Tensor
    visual_mask: torch.Tensor | None = None
    deepstack: list[torch.Tensor] | None = None

    def text_model_inputs(self) -> dict[str, Any]:
        """The text model's keyword arguments for a pass over the whole sequence."""
        out: dict[str, Any] = {"position_ids": self.position_ids}
        if self.visual_mask is not None:
            out.update(visual_pos_masks=self.visual_mask, deepstack_visual_embeds=self.deepstack)
        return out


class _LastImages:
    """The last vision pass's image inputs and deepstack features (one batch's), for ``positions``. Never pickled
    or copied: a collate's view of the backbone (``collation_view``) goes to loader workers without them."""

    key: tuple[torch.Tensor, torch.Tensor] | None = None
    deepstack: list[torch.Tensor] | None = None

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.key = self.deepstack = None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


@BACKBONES.register("qwen3_vl")
class Qwen3VLBackbone(Qwen2VLBackbone):
    """Qwen3-VL (Qwen3VLForConditionalGeneration): Qwen2-VL's inputs plus DeepStack features in the LLM."""

    kind = "qwen3_vl"
    model_class = "Qwen3VLForConditionalGeneration"
    model_types = ("qwen3_vl",)
    unquantized = ("lm_head", ".*visual")  # the tower, its merger and the deepstack mergers

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.kept_images = _LastImages()

    @classmethod
    def tiny(cls, texts: list[str], seed: int = 0) -> tuple[nn.Module, Any]:
        """A 32 x 32 image is 8 x 8 patches, 4 x 4 merged tokens; the ViT's blocks 0 and 1 of 3 give deepstack
        features that the LLM adds after both of its layers (the 8B: blocks 8, 16, 24 of 27 into LLM layers 0-2);
        a 4 x 4 learned position grid interpolated to the image's (the 8B's is 48 x 48); interleaved M-RoPE sections
        over a head of 16 (the 8B's [24, 20, 20] over 128)."""
        return cls.tiny_from_tokenizer(qwen_tokenizer(texts, QWEN3_VL_TEMPLATE), seed)

    @classmethod
    def tiny_from_tokenizer(cls, tok: Any, seed: int = 0) -> tuple[nn.Module, Any]:
        """``tiny`` over a given tokenizer (Qwen's special tokens, ``<|im_end|>`` its EOS, a chat template): the
        chat-format test's byte-level one."""
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        ids = tok.convert_tokens_to_ids
        cfg = Qwen3VLConfig(
            vision_config={"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
                           "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64,
                           "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1]},
            text_config={"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                         "max_position_embeddings": 256, "pad_token_id": tok.pad_token_id,
                         "rope_parameters": {"rope_type": "default", "mrope_section": [4, 2, 2],
                                             "mrope_interleaved": True, "rope_theta": 1e4}},
            image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        )
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(cfg)
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
        processor = qwen_image_processor(4, mean=[0.5] * 3, std=[0.5] * 3)  # the 8B's mean and std
        return model, ImageTokenProcessor(tok, processor, tok.chat_template)

    # -- vision ---------------------------------------------------------------------------------
    def _images(self, batch: Batch) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """(rows with an image, their patches one after another, their grids) -- the tower's inputs."""
        has = self.image_rows(batch)
        rows = has.nonzero().flatten().tolist()
        grid = batch.inputs["image_grid_thw"][has]
        flat = torch.cat([batch.pixel_values[i, :c] for i, c in zip(rows, grid.prod(-1).tolist())]).to(self.dtype)
        return rows, flat, grid

    def _vision(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor] | None]:
        """One tower pass: (merged image tokens of the rows with an image, each row's mean merged token, the
        deepstack features of those tokens per layer or None without images); keeps the deepstack features."""
        pooled = batch.pixel_values.new_zeros(batch.pixel_values.shape[0], self.image_query_dim, dtype=self.dtype)
        if not bool(self.image_rows(batch).any()):
            return pooled.new_zeros(0, 1, self.hidden_size), pooled, None
        rows, flat, grid = self._images(batch)
        out = self.model.model.get_image_features(flat, grid, return_dict=True)
        parts = out.pooler_output
        pooled[rows] = torch.stack([p.mean(0) for p in parts]).to(pooled.dtype)
        deepstack = [torch.cat(list(f)) for f in out.deepstack_features]
        self.kept_images.key, self.kept_images.deepstack = (flat, grid), deepstack
        return torch.cat(list(parts)), pooled, deepstack

    def vision(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen2-VL's (merged image tokens, mean merged token of each row); the deepstack features of the same pass
        are kept for ``positions``."""
        feats, pooled, _ = self._vision(batch)
        return feats, pooled

    def _deepstack(self, batch: Batch) -> list[torch.Tensor] | None:
        """The batch's deepstack features: the last tower pass's where it saw the same images, else a new pass."""
        if not bool(self.image_rows(batch).any()):
            return None
        _, flat, grid = self._images(batch)
        key = self.kept_images.key
        if key is not None and _same(key[0], flat) and _same(key[1], grid):
            return self.kept_images.deepstack
        return self._vision(batch)[2]

    # -- the language model -----------------------------------------------------------------------
    @torch.no_grad()
    def positions(self, batch: Batch) -> DeepstackPositions:
        """M-RoPE positions (Qwen2-VL's), the image-token mask and the deepstack features of the batch."""
        deepstack = self._deepstack(batch)
        mask = None if deepstack is None else batch.inputs["input_ids"] == self.image_token_id
        return DeepstackPositions(super().positions(batch), mask, deepstack)

    def insert_prompts(self, embeds: torch.Tensor, attention_mask: torch.Tensor, prompts: torch.Tensor | None,
                       labels: torch.Tensor | None = None, positions: Any = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Any]:
        """The base's insertion (the prompts take the first real token's position, later tokens move P on); the
        image-token mask gets False at the prompt slots, so the deepstack features stay on the image tokens."""
        if not isinstance(positions, DeepstackPositions):
            return super().insert_prompts(embeds, attention_mask, prompts, labels, positions)
        e, m, lab, pos = super().insert_prompts(embeds, attention_mask, prompts, labels, positions.position_ids)
        mask = positions.visual_mask
        if mask is not None and prompts is not None and prompts.shape[1]:
            first = (attention_mask.cumsum(1) == 0).sum(1).tolist()  # leading pads, where the prompts go
            gap = mask.new_zeros(prompts.shape[1])
            mask = torch.stack([torch.cat([mask[i, :f], gap, mask[i, f:]]) for i, f in enumerate(first)])
        return e, m, lab, replace(positions, position_ids=pos, visual_mask=mask)

    def logits(self, embeds: torch.Tensor, attention_mask: torch.Tensor, positions: Any = None) -> torch.Tensor:
        """The text model with the deepstack features, then ``lm_head`` (Qwen3VLForConditionalGeneration's forward
        on embeddings would leave them out)."""
        if not isinstance(positions, DeepstackPositions):
            return super().logits(embeds, attention_mask, positions)
        out = self.language_model(inputs_embeds=embeds, attention_mask=attention_mask, use_cache=False,
                                  **positions.text_model_inputs())
        return self.model.lm_head(out.last_hidden_state)

    @torch.no_grad()
    def generate(self, embeds: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 positions: Any = None, seen_ids: torch.Tensor | None = None) -> list[str]:
        """Batched greedy decoding with the KV cache: the prompt's pass with the deepstack features, then one text
        token a step, at the last position + 1 in every M-RoPE row (transformers' rule); the checkpoint's decoding
        settings (``MLLMBackbone.greedy_loop``)."""
        if not isinstance(positions, DeepstackPositions):
            return super().generate(embeds, attention_mask, max_new_tokens, positions, seen_ids)
        lm, head, table = self.language_model, self.model.lm_head, self.model.get_input_embeddings()
        first = lm(inputs_embeds=embeds, attention_mask=attention_mask, use_cache=True, **positions.text_model_inputs())
        last = positions.position_ids[:, :, -1:]
        mask = [attention_mask]

        def advance(tok: torch.Tensor, step: int, out: Any) -> Any:
            mask[0] = torch.cat([mask[0], mask[0].new_ones(len(tok), 1)], 1)
            return lm(inputs_embeds=table(tok)[:, None], attention_mask=mask[0], position_ids=last + step + 1,
                      past_key_values=out.past_key_values, use_cache=True)

        return self.greedy_loop(first, lambda out: head(out.last_hidden_state[:, -1]), advance, max_new_tokens,
                                seen_ids)
