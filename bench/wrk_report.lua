-- wrk script of bench/api.py: an optional request body, and a machine-readable summary with
-- latency percentiles. Method and body come from the environment (WRK_METHOD, WRK_BODY);
-- headers such as Authorization are passed with wrk's -H.
local method = os.getenv("WRK_METHOD")
local body = os.getenv("WRK_BODY")
if method then
    wrk.method = method
end
if body and body ~= "" then
    wrk.body = body
    wrk.headers["Content-Type"] = "application/json"
end

function done(summary, latency, requests)
    local e = summary.errors
    io.write(string.format(
        "WRK_JSON {\"requests\":%d,\"duration_us\":%d,\"bytes\":%d,\"connect\":%d,\"read\":%d," ..
        "\"write\":%d,\"status\":%d,\"timeout\":%d,\"p50_us\":%d,\"p90_us\":%d,\"p99_us\":%d," ..
        "\"mean_us\":%.1f,\"max_us\":%d}\n",
        summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status,
        e.timeout, latency:percentile(50), latency:percentile(90), latency:percentile(99),
        latency.mean, latency.max))
end
