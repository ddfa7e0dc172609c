"""Secrets kept out of what a run writes down: the command line in the model card (`redact`) and every log line
(`RedactingFilter`)."""

import logging
import re

REDACTED = "REDACTED"  # no shell metacharacters: the card quotes the command line for a shell
SECRET_FLAG = re.compile(r"^--?(?:\w+_)?(?:token|secret|password|passwd|api_key|apikey|credentials?)$", re.IGNORECASE)
SECRET_TEXT = (
    (re.compile(r"\bhf_[A-Za-z0-9]{8,}"), REDACTED),  # a Hugging Face token
    # NAME=value whose name ends like a secret's (HF_TOKEN=..., --hub_token=..., ?access_token=... in a URL)
    (re.compile(r"(?i)\b([A-Za-z_]*(?:token|secret|password|passwd|api_key|apikey)=)[^\s&]+"), rf"\1{REDACTED}"),
    (re.compile(r"(://)[^/\s@]+@"), rf"\1{REDACTED}@"),  # user:password@ in a URL
)


def redact_text(text: str) -> str:
    """`text` with Hub tokens, NAME=secret pairs and the credentials of URLs replaced by REDACTED."""
    for pattern, replacement in SECRET_TEXT:
        text = pattern.sub(replacement, text)
    return text


def redact(argv: list[str]) -> list[str]:
    """A command line fit to be written down: the value of every secret-like flag (--hub_token, --token,
    --*_password, ...) and any token-like text (see `redact_text`) replaced by REDACTED."""
    out, secret_next = [], False
    for arg in map(str, argv):
        name, equals, _ = arg.partition("=")
        if secret_next:
            out.append(REDACTED)
            secret_next = False
        elif SECRET_FLAG.match(name):
            out.append(f"{name}={REDACTED}" if equals else arg)
            secret_next = not equals
        else:
            out.append(redact_text(arg))
    return out


class RedactingFilter(logging.Filter):
    """Redacts secrets (`redact_text`) from every record a handler emits."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, ()
        return True
