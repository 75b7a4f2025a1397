"""WikiText-103 perplexity, LAMBADA and RACE accuracy with the reference implementations' conventions."""
