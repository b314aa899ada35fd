"""Token deltas -> text deltas for one request: detokenize, then stop strings.

The texts of all TextDeltas concatenated equal `tokenizer.decode(all ids)`, cut
at the first stop string (kept or not per include_stop_str_in_output).

With `min_tokens`, the text of the first min_tokens output tokens is never part of
a stop string (as the engine bans EOS and stop ids before min_tokens): the matcher
sees only the text that comes after them.

When a stop string matches, the TextDelta has finish_reason=STOP and
stop_reason=<the string>; the caller then aborts the request on the engine.
Tokens after the one that completed the stop string are not output: their ids
and logprobs are dropped and `num_output_tokens` counts tokens up to and
including that one (the engine's count minus the dropped tokens), as if the
engine had stopped there itself. After the finish, push() returns empty deltas.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from deltas.detokenizer import IncrementalDetokenizer
from deltas.stop_strings import StopStringMatcher
from deltas.types import FinishReason, TextDelta, TokenDelta

if TYPE_CHECKING:
    from deltas.tokenization.tokenizer import Tokenizer


class TextStream:
    __slots__ = ("_detokenizer", "_matcher", "_is_finished", "_num_unmatched_left")

    def __init__(
        self,
        tokenizer: "Tokenizer",
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        stops = [s for s in (stop or []) if s]
        self._matcher = StopStringMatcher(stops, include_stop_str_in_output) if stops else None
        self._is_finished = False
        # output tokens whose text is still outside stop matching (min_tokens)
        self._num_unmatched_left = min_tokens

    @property
    def finished(self) -> bool:
        return self._is_finished

    def push(self, delta: TokenDelta) -> TextDelta:
        if self._is_finished:
            return TextDelta("", num_prompt_tokens=delta.num_prompt_tokens)
        if self._matcher is not None and self._num_unmatched_left:
            return self._push_before_min_tokens(delta)
        state = self._detokenizer.get_state() if self._matcher is not None and len(delta.token_ids) > 1 else None
        text = self._detokenizer.push(delta.token_ids)
        if delta.finished:
            text += self._detokenizer.flush()
        if self._matcher is None:
            self._is_finished = delta.finished
            return _text_delta(delta, text)
        emitted, stop_str = self._matcher.push(text)
        if stop_str is not None:
            return self._stop_at(delta, emitted, stop_str, state)
        if delta.finished:
            emitted += self._matcher.flush()
            self._is_finished = True
        return _text_delta(delta, emitted)

    def _push_before_min_tokens(self, delta: TokenDelta) -> TextDelta:
        """A delta that starts within min_tokens: its first tokens' text is emitted as
        it is, the rest's goes through the matcher (a stop there counts them all)."""
        num_free = min(self._num_unmatched_left, len(delta.token_ids))
        self._num_unmatched_left -= num_free
        free_text = self._detokenizer.push(delta.token_ids[:num_free])
        rest = delta.token_ids[num_free:]
        state = self._detokenizer.get_state() if len(rest) > 1 else None
        text = self._detokenizer.push(rest) if rest else ""
        if delta.finished:
            text += self._detokenizer.flush()
        emitted, stop_str = self._matcher.push(text) if text else ("", None)
        if stop_str is not None:
            stopped = self._stop_at(_tail(delta, len(rest)), emitted, stop_str, state)
            num_dropped = len(rest) - len(stopped.token_ids)
            return _text_delta(_head(delta, len(delta.token_ids) - num_dropped),
                               free_text + emitted, FinishReason.STOP, stop_str)
        if delta.finished:
            emitted += self._matcher.flush()
            self._is_finished = True
        return _text_delta(delta, free_text + emitted)

    def _stop_at(self, delta: TokenDelta, text: str, stop_str: str, state: object) -> TextDelta:
        self._is_finished = True
        num_kept = self._num_tokens_to_stop(delta.token_ids, state)
        num_dropped = len(delta.token_ids) - num_kept
        out = TextDelta(
            text,
            token_ids=delta.token_ids[:num_kept],
            logprobs=None if delta.logprobs is None else delta.logprobs[:num_kept],
            top_logprobs=None if delta.top_logprobs is None else delta.top_logprobs[:num_kept],
            finish_reason=FinishReason.STOP,
            stop_reason=stop_str,
            num_prompt_tokens=delta.num_prompt_tokens,
            num_output_tokens=delta.num_output_tokens - num_dropped,
        )
        return out

    def _num_tokens_to_stop(self, token_ids: list[int], state: object) -> int:
        """How many of `token_ids` it took to complete the stop string.

        Rare path (once per request): replay the delta token by token from the
        detokenizer state saved before it, until the text reaches the match end.
        """
        if state is None:
            return len(token_ids)
        match_end = self._matcher.last_match_end
        self._detokenizer.set_state(state)
        num_chars = 0
        for index, token_id in enumerate(token_ids):
            num_chars += len(self._detokenizer.push([token_id]))
            if num_chars >= match_end:
                return index + 1
        return len(token_ids)  # the match needed the final flush


def _text_delta(delta: TokenDelta, text: str, finish_reason: FinishReason | None = None,
                stop_reason: str | None = None) -> TextDelta:
    return TextDelta(
        text,
        token_ids=delta.token_ids,
        logprobs=delta.logprobs,
        top_logprobs=delta.top_logprobs,
        finish_reason=finish_reason or delta.finish_reason,
        stop_reason=stop_reason or delta.stop_reason,
        num_prompt_tokens=delta.num_prompt_tokens,
        num_output_tokens=delta.num_output_tokens,
        error=delta.error,
    )


def _head(delta: TokenDelta, num_tokens: int) -> TokenDelta:
    """The delta cut after its first num_tokens tokens (the output count with it)."""
    num_dropped = len(delta.token_ids) - num_tokens
    return msgspec.structs.replace(
        delta, token_ids=delta.token_ids[:num_tokens],
        logprobs=None if delta.logprobs is None else delta.logprobs[:num_tokens],
        top_logprobs=None if delta.top_logprobs is None else delta.top_logprobs[:num_tokens],
        num_output_tokens=delta.num_output_tokens - num_dropped)


def _tail(delta: TokenDelta, num_tokens: int) -> TokenDelta:
    """The delta's last num_tokens tokens, as _stop_at reads them."""
    start = len(delta.token_ids) - num_tokens
    return msgspec.structs.replace(
        delta, token_ids=delta.token_ids[start:],
        logprobs=None if delta.logprobs is None else delta.logprobs[start:],
        top_logprobs=None if delta.top_logprobs is None else delta.top_logprobs[start:])
