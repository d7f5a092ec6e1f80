"""Token ids -> text for each sequence: incremental detokenization, stop strings, logprobs."""
from __future__ import annotations

from ember.request import (CompletionOutput, FinishReason, Request, SampledLogprob,
                           TokenLogprob, TopLogprob)
from ember.tokenizer.tokenizer import Tokenizer


class SequenceText:
    """The text of one generated sequence, built token by token.

    Stop strings are matched across token boundaries. While streaming, the tail that could still
    turn out to start a stop string is held back, so a stop string is never shown.

    Disaggregated, one sequence's text is shown by two replicas: the prefill replica's ends
    where its stream would be while going on (`continues_elsewhere`: the held-back tail is
    not shown), and the decode replica's starts there (`num_shown_elsewhere` first tokens
    taken in at once, as shown): together they are one replica's text.
    """

    def __init__(self, tokenizer: Tokenizer, request: Request, index: int,
                 num_shown_elsewhere: int = 0) -> None:
        self.tokenizer = tokenizer
        self.request = request
        self.index = index
        self.params = request.params
        self._detokenizer = tokenizer.detokenizer(self.params.skip_special_tokens)
        self._num_tokens_seen = 0     # tokens taken into the text
        self._num_tokens_streamed = 0
        self.text = ""
        self.stop_reason: str | int | None = None
        self.stopped_by_string = False
        self.logprobs: list[TokenLogprob] | None = [] if self.params.logprobs is not None else None
        self._holdback = max((len(s) for s in self.params.stop), default=1) - 1
        self.num_chars_streamed = 0
        self.continues_elsewhere = False
        if num_shown_elsewhere:
            self.update()
            self.num_chars_streamed = max(0, len(self.text) - self._holdback)
            self._num_tokens_streamed = num_shown_elsewhere

    def update(self) -> bool:
        """Take in the request's new tokens. Returns True when a stop string ended it."""
        if self.stopped_by_string:
            return False
        new_ids = self.request.output_token_ids[self._num_tokens_seen:]
        new_logprobs = self.request.output_logprobs[self._num_tokens_seen:]
        for k, token_id in enumerate(new_ids):
            self._num_tokens_seen += 1
            if self.logprobs is not None and k < len(new_logprobs):
                self.logprobs.append(self._token_logprob(token_id, new_logprobs[k]))
            search_from = max(0, len(self.text) - self._holdback)
            self.text += self._detokenizer.push(token_id)
            if self.params.stop and self._find_stop(search_from):
                return True
        if self.request.finish_reason is not None and \
                self.request.output_token_ids and self.stop_reason is None:
            last = self.request.output_token_ids[-1]
            if last in self.params.stop_token_ids:
                self.stop_reason = last
        return False

    def _find_stop(self, search_from: int) -> bool:
        hits = [(self.text.find(s, search_from), s) for s in self.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        idx, stop = min(hits)
        end = idx + len(stop) if self.params.include_stop_str_in_output else idx
        self.text = self.text[:end]
        self.stop_reason = stop
        self.stopped_by_string = True
        return True

    def _token_logprob(self, token_id: int, raw: SampledLogprob) -> TokenLogprob:
        text = self.tokenizer.token_text
        return TokenLogprob(token_id, text(token_id), raw.logprob,
                            tuple(TopLogprob(t, text(t), lp) for t, lp in raw.top))

    @property
    def finish_reason(self) -> FinishReason | None:
        return FinishReason.STOP if self.stopped_by_string else self.request.finish_reason

    def stream_delta(self) -> str:
        """New text that is safe to show: all of it once finished, else minus the holdback."""
        end = len(self.text) if self.finish_reason is not None and \
            not self.continues_elsewhere else \
            max(self.num_chars_streamed, len(self.text) - self._holdback)
        delta = self.text[self.num_chars_streamed:end]
        self.num_chars_streamed = end
        return delta

    @property
    def token_ids(self) -> list[int]:
        """The generated tokens up to and including the one that ended it."""
        return self.request.output_token_ids[:self._num_tokens_seen]

    def take_delta(self) -> CompletionOutput:
        """What is new since the last call: safe text, token ids, their logprobs."""
        start, self._num_tokens_streamed = self._num_tokens_streamed, self._num_tokens_seen
        logprobs = self.logprobs[start:self._num_tokens_seen] if self.logprobs is not None \
            else None
        return CompletionOutput(index=self.index, text=self.stream_delta(),
                                token_ids=self.request.output_token_ids[start:self._num_tokens_seen],
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason,
                                logprobs=logprobs)

    def output(self) -> CompletionOutput:
        return CompletionOutput(index=self.index, text=self.text,
                                token_ids=self.token_ids,
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason,
                                logprobs=list(self.logprobs) if self.logprobs is not None else None)
