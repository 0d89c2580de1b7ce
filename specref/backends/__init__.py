"""Device-specific speed paths, behind the core's back: the algorithms never depend on them.

    cpu_linear.py  CPU fp32: nn.Linear weights pre-packed for oneDNN, so that a verify block of
                   k+1 tokens costs little more than one token (target.py and the EAGLE head use it)
"""
