"""Text <-> token ids, from a checkpoint's tokenizer.json (the `tokenizers` library), with streaming
detokenization that never emits half a UTF-8 character."""

from pathlib import Path

from appliance.errors import ContextLengthError, ModelLoadError, RequestError


class TextTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises its own exception types
            raise ModelLoadError(f"{path}: not a tokenizers tokenizer.json ({e})", field="tokenizer.json") from None
        self.path = path

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)


class NoTokenizer:
    """Models shipped without tokenizer.json (tiny test models) take and give token ids only."""

    vocab_size = 0

    def encode(self, text: str) -> list[int]:
        raise RequestError("this model has no tokenizer.json: send input_ids instead of text", field="prompt")

    def decode(self, ids: list[int]) -> str:
        return ""

    def token_id(self, token: str) -> int | None:
        return None


def load_tokenizer(model_dir) -> TextTokenizer | NoTokenizer:
    path = Path(model_dir) / "tokenizer.json"
    return TextTokenizer(path) if path.is_file() else NoTokenizer()


class StreamDecoder:
    """Turns ids into text increments: decodes the running tail and holds back text that still ends in
    an incomplete character (U+FFFD), so every emitted piece is final."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.start = 0  # first id not yet fully emitted
        self.emitted = ""  # text emitted for ids[start:]

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tok.decode(self.ids[self.start:])
        if text.endswith("\ufffd"):
            return ""
        piece = text[len(self.emitted):]
        self.emitted = text
        if len(self.ids) - self.start > 8:  # keep the re-decoded tail short
            self.start, self.emitted = len(self.ids), ""
        return piece

    def flush(self) -> str:
        text = self.tok.decode(self.ids[self.start:])
        piece = text[len(self.emitted):]
        self.start, self.emitted = len(self.ids), ""
        return piece


def check_ids(ids: list[int], cfg, limit: int, reserve: int = 0) -> None:
    """The one check of a prompt's ids: not empty, inside the vocabulary, no image token (text only), and
    `len(ids) + reserve` (the tokens still to generate) within `limit` positions of context."""
    if not ids:
        raise RequestError("the prompt encodes to no tokens", field="prompt")
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise RequestError(f"input_ids: {len(bad)} id(s) outside the vocabulary 0..{cfg.vocab_size - 1} "
                           f"(first: {bad[0]})", field="input_ids", value=bad[0])
    image = getattr(cfg, "image_token_id", None)
    if image is not None and image in ids:
        raise RequestError(f"input_ids: image token {image} found; this server is text only",
                           field="input_ids", value=image)
    if len(ids) + reserve > limit:
        what = f"prompt of {len(ids)} tokens" + (f" + max_tokens {reserve}" if reserve else "")
        raise ContextLengthError(f"{what} exceeds the context limit {limit}",
                                 field="max_tokens" if len(ids) < limit else "prompt", value=len(ids))
