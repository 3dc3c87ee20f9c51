"""Tokenizer and chat template: text in, token ids out, and back.

Wraps a ``tokenizers.Tokenizer`` (from ``tokenizer.json`` or built from GGUF metadata) with
the special tokens the engine needs and the model's chat template. Chat templates come
from the checkpoint, which may be hostile, so they are rendered in jinja2's immutable
sandbox with the same globals and filters transformers provides, giving byte-identical text.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any, Sequence

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed."""


@dataclasses.dataclass
class Tokenizer:
    tokenizer: tokenizers.Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)  # for the template
    eos_token_ids: tuple[int, ...] = ()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render a conversation to the prompt text the model was trained on."""
        if not self.chat_template:
            raise ChatTemplateError(
                "this model has no chat template (none in tokenizer_config.json, chat_template.jinja "
                "or the GGUF metadata); use generate() with a plain prompt instead"
            )
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            **self.special_tokens, **extra,
        )

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        """``extra``: more template variables, such as ``tools``."""
        # The template already places BOS where the model expects it, as transformers assumes.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra), add_special_tokens=False)

    @classmethod
    def from_hf_dir(cls, path: str | Path, extra_eos_ids: Sequence[int] = ()) -> "Tokenizer":
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.exists():
            raise FileNotFoundError(f"{tokenizer_file} not found: jaxinfer needs a tokenizer.json (fast tokenizer)")
        tok = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        cfg = _read_json(path / "tokenizer_config.json")
        special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        special_map = _read_json(path / "special_tokens_map.json")
        for k, v in special_map.items():
            if isinstance(v, (str, dict)) and not special.get(k):
                special[k] = _token_text(v)
        special = {k: v for k, v in special.items() if v is not None}
        template = _chat_template_from_config(cfg)
        template_file = path / "chat_template.jinja"
        if template_file.exists():
            template = template_file.read_text()
        eos_ids = list(extra_eos_ids)
        if special.get("eos_token") and tok.token_to_id(special["eos_token"]) is not None:
            eos_ids.append(tok.token_to_id(special["eos_token"]))
        generation = _read_json(path / "generation_config.json").get("eos_token_id")
        eos_ids += generation if isinstance(generation, list) else ([generation] if generation is not None else [])
        return cls(
            tokenizer=tok,
            chat_template=template,
            bos_token=special.get("bos_token"),
            eos_token=special.get("eos_token"),
            special_tokens=special,
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _chat_template_from_config(cfg: dict[str, Any]) -> str | None:
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one serves chat
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # transformers' tojson: unlike jinja2's, it does not HTML-escape.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENVIRONMENT = _environment()


def render_chat_template(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any) -> str:
    """Render ``template`` in the sandbox; template errors become :class:`ChatTemplateError`."""
    try:
        compiled = _ENVIRONMENT.from_string(template)
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except ChatTemplateError:
        raise
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"the chat template tried an unsafe operation: {e}") from None
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed to render: {e}") from None
