# Shared by the load benchmarks: free ports, process cleanup, readiness waits, and a floodgate
# gateway in front of $upstream_port with never-denying limits. Sourced, not run.

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
work=$(mktemp -d)
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
wait_for() { for _ in $(seq 100); do curl -kfs "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done; echo "not up: $1" >&2; exit 1; }

# Starts `floodgate serve` with the given YAML (a `store:` section, a `listen_tls:`); sets
# $started_port. With `https` as second argument, readiness is checked over TLS. Runs
# $floodgate_bin when set (another build), else target/release/floodgate.
start_floodgate() { # yaml [scheme]
    local port admin; port=$(free_port); admin=$(free_port)
    cat > "$work/floodgate-$port.yaml" <<YAML
listen: "127.0.0.1:$port"
admin: { listen: "127.0.0.1:$admin" }
upstream: "http://127.0.0.1:$upstream_port"
$1
plans:
  anonymous:
    limits: [ { name: per-second, algorithm: token_bucket, limit: 100000000, window: 1s } ]
  free:
    limits: [ { name: per-second, algorithm: token_bucket, limit: 100000000, window: 1s } ]
YAML
    RUST_LOG=warn "${floodgate_bin:-target/release/floodgate}" serve --config "$work/floodgate-$port.yaml" >/dev/null 2>"$work/floodgate-$port.log" &
    pids+=($!); started_pid=$!
    wait_for "${2:-http}://127.0.0.1:$port/"
    started_port=$port
}

# Starts nginx in front of $upstream_port: proxy_pass with upstream keepalive and a limit_req
# zone set too high to reject, 2 workers. With a TLS port as argument, also listens there with
# $work/tls.crt and $work/tls.key. Sets $nginx_port and $nginx_pid (the master's).
start_nginx() { # [tls_port]
    nginx_port=$(free_port)
    local tls_listen=""
    if [ -n "${1:-}" ]; then
        tls_listen="listen 127.0.0.1:$1 ssl;
        ssl_certificate $work/tls.crt;
        ssl_certificate_key $work/tls.key;"
    fi
    mkdir -p "$work/nginx"
    cat > "$work/nginx/nginx.conf" <<NGINX
worker_processes auto;
pid $work/nginx/nginx.pid;
error_log $work/nginx/error.log;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path $work/nginx; proxy_temp_path $work/nginx;
    fastcgi_temp_path $work/nginx; uwsgi_temp_path $work/nginx; scgi_temp_path $work/nginx;
    limit_req_zone \$binary_remote_addr zone=perip:10m rate=100000000r/s;
    upstream backend { server 127.0.0.1:$upstream_port; keepalive 256; }
    server {
        listen 127.0.0.1:$nginx_port;
        $tls_listen
        location / {
            limit_req zone=perip burst=100000000 nodelay;
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
    }
}
NGINX
    nginx -c "$work/nginx/nginx.conf" -g 'daemon off;' & pids+=($!); nginx_pid=$!
    wait_for "http://127.0.0.1:$nginx_port/"
}

# What the wrk run in $work/wrk.txt measured, on one line: requests per second, p50, p99,
# non-2xx answers (0 when wrk printed none) and requests.
wrk_figures() {
    awk '/Requests\/sec/ {rps = $2} $1 == "50%" {p50 = $2} $1 == "99%" {p99 = $2}
         /Non-2xx/ {non2xx = $NF} /requests in/ {requests = $1}
         END {print rps, p50, p99, non2xx + 0, requests}' "$work/wrk.txt"
}

# One wrk run of $seconds with $connections against 127.0.0.1:port (over `scheme`, default
# http): requests per second, p50, p99 and non-2xx answers on one line.
load() { # name port [scheme]
    wrk -t1 -c"$connections" -d"${seconds}s" --latency "${3:-http}://127.0.0.1:$2/" > "$work/wrk.txt"
    local rps p50 p99 non2xx requests
    read -r rps p50 p99 non2xx requests < <(wrk_figures)
    printf '%-26s %12s req/s   p50 %8s   p99 %8s   non-2xx %s\n' "$1" "$rps" "$p50" "$p99" "${non2xx:-0}"
}

# The Lua function library of REVISION ("work": the working tree) as script.rs assembles it
# (the files its include_str! lines name, in their order) under the header of library NAME, with
# its check function registered as NAME_check. FILTER, when given, is a command each file goes
# through as `FILTER path` (reading the file from stdin).
lua_library() { # revision name [filter]
    local revision=$1 name=$2 filter=${3:-as_is} file
    show() { if [ "$revision" = work ]; then cat "$1"; else git show "$revision:$1"; fi; }
    echo "#!lua name=$name"
    for file in $(show crates/floodgate/src/store/redis/script.rs | sed -n '/^fn library_body/,/^}/p' |
        grep -oE 'lua/[a-z_]+\.lua'); do
        show "crates/floodgate/$file" | "$filter" "$file"
        echo
    done
    echo "redis.register_function('${name}_check', floodgate_check)"
}

as_is() { cat; }

# Starts a redis-server on a free port with no persistence; sets $redis_port and rcli.
start_redis() {
    redis_port=$(free_port)
    redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no --logfile '' >/dev/null &
    pids+=($!)
    for _ in $(seq 50); do redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break; sleep 0.1; done
}
rcli() { redis-cli -p "$redis_port" "$@"; }
