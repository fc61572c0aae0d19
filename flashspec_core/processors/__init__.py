"""What turns the target's logits into the law a token is drawn from, along every draft path:
the sampling settings and their float32 transform (sampling.py), HF's repetition penalty
(penalty.py) and the n-gram ban (ngram_ban.py). The target and every draft go through them alike."""
