"""`python -m specref bench`: every decoding method side by side on Spec-Bench, in one process.

    runner.py   the questions, the interleaved runs, the command line (bench_main)
    methods.py  the model under test and one runner per method (specref's and transformers')
    report.py   the summary (tokens/s, speed-up, tau, acceptance, costs), Markdown, the plot
"""
