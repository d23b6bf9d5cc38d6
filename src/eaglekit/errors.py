"""The one error type for anything a user can cause. Its message always says what to fix."""


class EaglekitError(Exception):
    """A problem with the user's input, files or environment; the message names the fix."""
