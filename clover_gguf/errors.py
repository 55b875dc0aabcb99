"""The one base of the errors a user sees as one line (``error: ...``, exit status 1, no
traceback): the converter's, the quantizer's, the reader's and the runtime's derive from it, so
a front end catches them all by this one name."""

from __future__ import annotations

__all__ = ["UserFacingError"]


class UserFacingError(Exception):
    """A problem with what the user gave (a file, a checkpoint, an argument) or asked for; the
    message is one line."""
