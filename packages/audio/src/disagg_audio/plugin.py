"""The ``audio`` entry point of group ``disagg``.

Audio families (e.g. ``whisper`` as an encoder) arrive with their own issue;
until then this plugin loads and registers nothing, so that an install of
``disagg-audio`` is visible in ``disagg plugins`` and the isolation session
has something to test.
"""
