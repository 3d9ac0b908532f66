"""The chat wing: DeepSeek V4 / V4.1 chat encoding (messages -> prompt text) and output parsing (model
text -> reasoning, content, tool calls), for the three prompt dialects of the family. Pure Python: it
imports nothing of the project but appliance.errors and appliance.api (the ChatRequest it encodes, the chat
roles, the sampling limits), so the server and the CLI can use it without torch.

    dialects.py   special tokens and ids, DSML tag names, effort tables, sampling defaults
    request.py    a ChatRequest -> ChatPrompt (validated; RequestError names the field)
    encoding.py   the reference encoder: messages -> prompt text
    dsml.py       the tool markup: tools block, tool calls in history
    output.py     the streaming output parser and parse()
    toolblock.py  one DSML tool-call block, parsed call by call
    defaults.py   sampling defaults of a checkpoint (generation_config.json, else the model card)

Spec: shared/spec/chat-encoding.md.
"""

from .defaults import sampling_defaults
from .dialects import DIALECTS, Dialect, dialect_for_model, get_dialect
from .encoding import encode_messages
from .output import OutputParser, ParsedMessage, TextDelta, ToolCallDelta, parse
from .request import MAX_DEPTH, ChatPrompt, check_depth, encode_request

__all__ = ["DIALECTS", "MAX_DEPTH", "ChatPrompt", "Dialect", "OutputParser", "ParsedMessage", "TextDelta",
           "ToolCallDelta", "check_depth", "dialect_for_model", "encode_messages", "encode_request", "get_dialect",
           "parse", "sampling_defaults"]
