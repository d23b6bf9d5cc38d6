"""The target generating text: `regen`'s turn plan, resumable files and job loops (`regen`), its backends (the target
in-process, or an OpenAI-compatible server: `backends`), and the OpenAI-compatible server of `eaglekit serve`
(`server`, with its HTTP side `server_api`, queue `server_jobs` and streamed text `server_text`).
"""
