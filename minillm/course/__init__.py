"""The course around the engine: what the chapters and the learner's exercises share.

    grading     plug the learner's exercises into the engine; score tables
    quiz        each chapter's questions, answers stored as salted digests
    capstone    python -m minillm capstone: the learner's pieces serving the model
    notebook    helpers the chapters share (one model, engines on it, runs)
    jupyter     the command behind ``make lab``
"""
