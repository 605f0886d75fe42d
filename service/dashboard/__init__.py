"""The web dashboard: one HTML page, one script and a stylesheet, served from `static/`.

The page itself needs no token; everything it shows comes from the REST API with the token the
user types in, kept in the browser's sessionStorage. Its chart library (uPlot) is vendored under
`static/vendor/` with its license, so the dashboard never loads anything from another origin.
"""
