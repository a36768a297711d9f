"""Incremental detokenisation: the output text, token by token, with stop strings.

The obvious way to build a request's text is to decode every output token again after
each new one and look for the stop strings in the result. That is correct, and
quadratic: token ``n`` costs a decode of ``n`` tokens, so a 4,000-token answer decodes
about eight million tokens in all. This module does what vLLM's detokenizer does and
decodes only a small window of recent tokens per step.

Why a window and not just the new token? Text is not a sum of per-token strings.
SmolLM2's tokenizer is byte-level BPE: a token is a few *bytes*, and an emoji or a CJK
character (3-4 bytes of UTF-8) may be split across two or three tokens. Decoded alone,
each of those tokens is invalid UTF-8 and comes out as "\\ufffd" (the replacement
character). Other tokenizers (SentencePiece) drop the leading space of the first token
they decode. So we decode each new token *together with* the tokens before it, and
keep two offsets into the token list:

    token ids:   ... | prefix_offset ... read_offset | read_offset ... end
                       '--- already turned into text --'  '--- new, not yet ---'

``prefix_text = decode(ids[prefix_offset:read_offset])`` is text we have already
produced; ``decode(ids[prefix_offset:])[len(prefix_text):]`` is exactly the text the new
tokens add. When that decode does not end in "\\ufffd", ``read_offset`` sits on a
character boundary: the window slides forward (prefix_offset <- read_offset,
read_offset <- end) and stays a token or two long. When it does end in "\\ufffd", the
last character may still be completed by the next token, so we wait, and the window
grows by one token. Special tokens (``<|im_end|>``...) never enter the window:
``skip_special_tokens=True`` drops them wherever they are, so a run of them cannot make
the window grow.

Stop strings are found the same way: only the new text, plus the last
``len(stop) - 1`` characters before it (where a match could have started), is
searched. A stop string can only appear at the token that completes it, so this finds
it at exactly the token where re-decoding everything would.

Why some text is held back from ``text``: a streaming client must never see text that
is later taken back. If the output ends in "Hello wor" and a stop string is "world", the
"wor" may become the start of the stop string (and be cut) or stay ordinary text; we
show it only once the next tokens decide. Likewise an incomplete character ("\\ufffd"
at the end) is shown only once it is complete. ``finish`` releases whatever is still
held when the request ends.

The output text is ``decode(output_ids, skip_special_tokens=True)``, the output alone:
the prompt is not decode context (with a byte-level tokenizer, context would only
matter for a character split between prompt and output, and then the output text
would no longer equal the decode of the output tokens).
"""
from __future__ import annotations

from typing import Any, Sequence

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a character

# A UTF-8 character is at most 4 bytes, so a real split character resolves within a few
# tokens. If the window's end has looked unfinished for longer than this, we look for a
# token boundary inside it that is already safe to commit (see _commit_safe_prefix).
_MAX_UNREAD_TOKENS = 4


class IncrementalDetokenizer:
    """Builds one request's output text as tokens arrive; finds its stop strings.

    Call ``add_token`` for every sampled output token, in order (including a final
    stop token or EOS), then ``finish`` once when the request ends.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: Any):
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids  # kept for callers; not decode context (see above)
        self.include_stop = bool(getattr(params, "include_stop_str_in_output", False))
        # With no tokenizer there is no text, so no stop string can match.
        self.stop: list[str] = list(params.stop) if tokenizer is not None else []
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.stop_str: str | None = None  # the stop string that ended the request, if one did
        self.num_tokens = 0  # output tokens seen by add_token
        # A stop string starts at most this many characters before the newest text.
        self._tail_len = max((len(s) for s in self.stop), default=1) - 1
        self._skip = _skipped_special_ids(tokenizer) if tokenizer is not None else frozenset()

        self._ids: list[int] = []  # output ids that carry text (specials left out)
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(_ids[_prefix_offset:_read_offset])
        # The text so far is committed + pending: "committed" ends on a character boundary
        # and never changes; "pending" is the text of _ids[_read_offset:], which ends in an
        # unfinished character and may still change.
        self._committed_len = 0
        self._tail = ""  # the last _tail_len committed characters: where a stop may begin
        self._pending = ""
        self._held = ""  # committed but not yet released: it may begin a stop string
        # Released text, the part the user sees, as pieces (joining on each token would
        # itself be quadratic). _streamed: how many pieces new_text() has handed out.
        self._pieces: list[str] = []
        self._streamed = 0
        self._text_cache: str | None = ""
        self._deferred: int | None = None  # a stop token whose text is left out unless it isn't the last
        self._stopped = False  # a stop string matched
        self._finished = False

    # -- the contract ---------------------------------------------------------
    def add_token(self, token_id: int) -> bool:
        """Append one sampled token's text. True if a stop string now appears (the request must stop)."""
        if self._stopped or self._finished:
            return self._stopped
        self.num_tokens += 1
        if self.tokenizer is None:
            return False
        if self._deferred is not None:  # the previous stop token was not the last after all
            token, self._deferred = self._deferred, None
            if self._append(token):
                return True
        if token_id in self.stop_token_ids and not self.include_stop:
            # A stop token ends the request, and its text is not part of the output (vLLM's
            # rule: stop_token_ids=[id('.')] gives ' Paris', not ' Paris.'). Holding it aside
            # instead of decoding it means its text is never shown and then retracted.
            self._deferred = token_id
            return False
        return self._append(token_id)

    @property
    def text(self) -> str:
        """The output text so far, as the user should see it (held-back text excluded).

        Joined from the released pieces when asked for, then cached until the next piece:
        for per-token streaming use new_text(), which costs only the new characters."""
        if self._text_cache is None:
            self._text_cache = "".join(self._pieces)
        return self._text_cache

    def new_text(self) -> str:
        """Text released since the last call (for streaming deltas)."""
        delta = "".join(self._pieces[self._streamed:])
        self._streamed = len(self._pieces)
        return delta

    def finish(self, reason: Any, last_token_is_stop_token: bool) -> str:
        """Called once when the request ends (for any reason). Releases what was held back,
        except a matched stop string (kept only with include_stop_str_in_output), and leaves
        out the text of a final stop token (also kept only with include_stop_str_in_output).
        Returns the final text. The text does not depend on ``reason``: a request that is
        aborted or hits its length limit keeps everything it produced."""
        if self._finished:
            return self.text
        self._finished = True
        if self._deferred is not None:
            token, self._deferred = self._deferred, None
            if not last_token_is_stop_token:  # it was sampled last but the request ended otherwise
                self._append(token)
        if not self._stopped:
            self._release(self._held + self._pending)
            self._held = self._pending = ""
        return self.text

    # -- one token --------------------------------------------------------------
    def _append(self, token_id: int) -> bool:
        if token_id in self._skip:  # decodes to nothing anywhere: no new text, no new stop
            return False
        old_committed_len, old_tail = self._committed_len, self._tail
        ids = self._ids
        ids.append(token_id)
        window = self._decode(ids[self._prefix_offset:])
        if not window.endswith(REPLACEMENT):
            committed = self._commit(window[len(self._prefix_text):], len(ids))
            self._pending = ""
        else:
            committed = ""
            self._pending = window[len(self._prefix_text):]
            if len(ids) - self._read_offset > _MAX_UNREAD_TOKENS:
                committed = self._commit_safe_prefix(window)
        if self.stop:
            # The text is committed + pending; search it from where a match ending in the
            # new text could start (old_tail is what precedes the new text there).
            hit = self._find_stop(old_tail + committed + self._pending,
                                  old_committed_len - len(old_tail), len(old_tail))
            if hit is not None:
                self._stop_at(*hit)
                return True
        self._release_safe()
        return False

    def _commit(self, piece: str, read_offset: int) -> str:
        """The text up to token read_offset is final: slide the window forward."""
        self._prefix_offset, self._read_offset = self._read_offset, read_offset
        # Decoded on its own rather than taken from `piece`: a tokenizer that drops the
        # leading space of the first token decodes this window differently.
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        self._committed_len += len(piece)
        self._held += piece
        if self._tail_len:
            self._tail = (self._tail + piece)[-self._tail_len:]
        return piece

    def _commit_safe_prefix(self, window: str) -> str:
        """The window has ended in "\\ufffd" for several tokens: garbage bytes that will
        never form a character, or a character still arriving. Find the latest token
        boundary k where nothing straddles: decoding the two sides separately gives the
        same text as decoding them together (a byte sequence cut in two would come out as
        two replacement characters instead of one character). Commit up to k, so that the
        window stops growing. Returns the committed text ("" if no such k)."""
        ids, p = self._ids, self._prefix_offset
        # Only the last few boundaries are tried, so that a window that keeps failing
        # (no token boundary on a character boundary) costs a bounded number of decodes.
        lowest = max(self._read_offset, len(ids) - 1 - 2 * _MAX_UNREAD_TOKENS)
        for k in range(len(ids) - 1, lowest, -1):
            head = self._decode(ids[p:k])
            rest = self._decode(ids[k:])
            # `rest` non-empty: there are bytes after k, so the split at k is already decided.
            if rest and head + rest == window and head.startswith(self._prefix_text):
                piece = self._commit(head[len(self._prefix_text):], k)
                self._pending = self._decode(ids[self._prefix_offset:])[len(self._prefix_text):]
                return piece
        return ""

    # -- stop strings -----------------------------------------------------------
    def _find_stop(self, searched: str, base: int, tail_len: int) -> tuple[int, str] | None:
        """The first stop-string occurrence in `searched` (which starts at absolute text
        position `base`) that ends in the new text. Rule: the earliest start wins; if two
        start together, the shorter (it ends first). Any occurrence that ended before the
        new text would have stopped the request at an earlier token."""
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            i = searched.find(s, max(0, tail_len - len(s) + 1))
            if i >= 0 and (best is None or (i, len(s)) < best[:2]):
                best = (i, len(s), s)
        return None if best is None else (base + best[0], best[2])

    def _stop_at(self, start: int, s: str) -> None:
        """Cut the text at the stop string (or just after it) and release the rest."""
        self._stopped = True
        self.stop_str = s
        end = start + (len(s) if self.include_stop else 0)
        released = self._committed_len - len(self._held)  # text positions before this are shown
        # Held-back text is never released past where a stop string could start, so the
        # cut is never before `released`: nothing shown is taken back.
        unreleased = self._held + self._pending
        self._release(unreleased[:max(0, end - released)])
        self._held = self._pending = ""

    def _release_safe(self) -> None:
        """Release committed text that can no longer become part of a stop string."""
        keep = 0
        if self.stop and not self.include_stop:
            # The longest end of the committed text that is the beginning of a stop string
            # (shorter than the whole string: a whole one would already have matched).
            # With include_stop_str_in_output nothing is held: the cut comes after the
            # stop string, so no text before it is ever removed.
            for s in self.stop:
                for j in range(min(len(s) - 1, len(self._tail)), keep, -1):
                    if self._tail.endswith(s[:j]):
                        keep = j
                        break
        keep = min(keep, len(self._held))
        if len(self._held) > keep:
            cut = len(self._held) - keep
            self._release(self._held[:cut])
            self._held = self._held[cut:]

    def _release(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self._text_cache = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _skipped_special_ids(tokenizer: Any) -> frozenset[int]:
    """Special tokens that decode to nothing: they can be left out of the window.

    transformers' ``all_special_ids`` may not list every added token the fast tokenizer
    treats as special (SmolLM2's ``<repo_name>`` and friends), so the added tokens are
    consulted too, and each candidate is checked: it must decode to "".
    """
    candidates = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    candidates.update(i for i, t in added.items() if getattr(t, "special", False))
    return frozenset(i for i in candidates
                     if isinstance(i, int) and tokenizer.decode([i], skip_special_tokens=True) == "")
