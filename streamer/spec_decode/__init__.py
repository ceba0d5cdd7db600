"""Speculative decoding: cheap guesses of a sequence's next tokens (`ngram_proposer.py`), checked
all at once by one forward of the target model over the paged cache, and kept or rejected so that
the output is distributed exactly as without them (`rejection_sampler.py`)."""
