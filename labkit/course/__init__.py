"""The course machinery: what turns labkit's measurements into a course a learner works through.

    quiz         quiz banks, validated, shown as widgets or text (``quizbank/`` holds them)
    sealed       opaque text for a job spec that its reader should not see plainly
    exam         the mock exam over every quiz bank
    capstone     notebook 07's slow job: faults, seeds, the job, its evidence
    exercises    the exercise registry, graded hints and the checks run in the kernel
    record       record notebook 01's run on a GPU for learners without one
    nbgen        the learners' notebooks, generated from the solutions
    timings      each notebook's run time per section, for a workshop's plan
    hosted       a hosted notebook's setup cell: labkit and its pins into a running kernel
    book         the rendered course: learners' notebooks executed, as a static site

Importing this folder imports none of them: ``from labkit.course import quiz``.
"""
