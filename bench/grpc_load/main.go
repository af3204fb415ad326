// grpc_load: a load generator for Envoy's rate limit service
// (envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit), written on grpc-go because
// that is the client the service meets in production (Envoy aside): it sends an HTTP/2 PING
// when data arrives (BDP estimation), which other clients do not, and a server that answers
// it badly stalls (see BENCHMARKS.md).
//
// `callers` goroutines call back to back over `conns` ClientConns (one HTTP/2 connection
// each) for `seconds`; each call's latency is kept, and the run prints one line:
//
//	calls_per_s=… p50_ms=… p99_ms=… calls=… ok=… over_limit=… errors=…
//
// The request is encoded by hand (no generated code): a raw-bytes codec registered as
// "proto" so that the content type stays application/grpc. RateLimitRequest: 1 domain
// (string), 2 descriptors (repeated RateLimitDescriptor{1 entries (repeated Entry{1 key,
// 2 value})}), 3 hits_addend (uint32, left out: 1). Of the reply only overall_code (field 1,
// varint: 1 OK, 2 OVER_LIMIT) is read.
//
// Build (Debian's golang-go and golang-google-grpc-dev, GOPATH mode, no module proxy):
//
//	GO111MODULE=off GOPATH=/usr/share/gocode go build -o grpc_load bench/grpc_load/main.go
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
)

// rawCodec passes pre-encoded request bytes through and hands the reply's bytes back.
type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) {
	bytes, ok := v.(*[]byte)
	if !ok {
		return nil, fmt.Errorf("rawCodec: cannot marshal %T", v)
	}
	return *bytes, nil
}

func (rawCodec) Unmarshal(data []byte, v interface{}) error {
	bytes, ok := v.(*[]byte)
	if !ok {
		return fmt.Errorf("rawCodec: cannot unmarshal into %T", v)
	}
	*bytes = append((*bytes)[:0], data...)
	return nil
}

func (rawCodec) Name() string { return "proto" }

func appendVarint(buffer []byte, value uint64) []byte {
	for value >= 0x80 {
		buffer = append(buffer, byte(value)|0x80)
		value >>= 7
	}
	return append(buffer, byte(value))
}

// appendField appends a length-delimited field.
func appendField(buffer []byte, field int, payload []byte) []byte {
	buffer = appendVarint(buffer, uint64(field<<3|2))
	buffer = appendVarint(buffer, uint64(len(payload)))
	return append(buffer, payload...)
}

// entry is one descriptor entry, key and value.
type entry struct{ key, value string }

// encodeRequest encodes a RateLimitRequest of `domain` with one descriptor per element of
// `descriptors`, each of the given entries.
func encodeRequest(domain string, descriptors [][]entry) []byte {
	request := appendField(nil, 1, []byte(domain))
	for _, descriptor := range descriptors {
		var encoded []byte
		for _, e := range descriptor {
			var fields []byte
			fields = appendField(fields, 1, []byte(e.key))
			fields = appendField(fields, 2, []byte(e.value))
			encoded = appendField(encoded, 1, fields)
		}
		request = appendField(request, 2, encoded)
	}
	return request
}

func readVarint(data []byte) (uint64, int, error) {
	var value uint64
	for i := 0; i < len(data) && i < 10; i++ {
		value |= uint64(data[i]&0x7f) << (7 * uint(i))
		if data[i] < 0x80 {
			return value, i + 1, nil
		}
	}
	return 0, 0, errors.New("truncated varint")
}

// overallCode reads field 1 of a RateLimitResponse (0, UNKNOWN, when absent).
func overallCode(data []byte) (uint64, error) {
	for len(data) > 0 {
		tag, n, err := readVarint(data)
		if err != nil {
			return 0, err
		}
		data = data[n:]
		switch tag & 7 {
		case 0:
			value, n, err := readVarint(data)
			if err != nil {
				return 0, err
			}
			if tag>>3 == 1 {
				return value, nil
			}
			data = data[n:]
		case 1:
			if len(data) < 8 {
				return 0, errors.New("truncated fixed64")
			}
			data = data[8:]
		case 2:
			length, n, err := readVarint(data)
			if err != nil || uint64(len(data)-n) < length {
				return 0, errors.New("truncated field")
			}
			data = data[n+int(length):]
		case 5:
			if len(data) < 4 {
				return 0, errors.New("truncated fixed32")
			}
			data = data[4:]
		default:
			return 0, fmt.Errorf("wire type %d", tag&7)
		}
	}
	return 0, nil
}

// percentile of sorted latencies (microseconds), in milliseconds.
func percentile(sorted []uint32, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	index := int(p * float64(len(sorted)-1))
	return float64(sorted[index]) / 1000
}

func main() {
	address := flag.String("addr", "127.0.0.1:8081", "the rate limit service, host:port")
	callers := flag.Int("callers", 64, "callers calling back to back")
	conns := flag.Int("conns", 4, "HTTP/2 connections (ClientConns), callers spread over them")
	seconds := flag.Float64("seconds", 8, "how long to call")
	domain := flag.String("domain", "bench", "the request's domain")
	users := flag.Int("users", 1000, "distinct `user` values, cycled through by each caller")
	descriptors := flag.Int("descriptors", 1, "1: {user}; 3: {user}, {org}, {route}")
	user := flag.String("user", "", "every call for this one user (e.g. one over its limit)")
	flag.Parse()
	if *callers < 1 || *conns < 1 || *users < 1 || (*descriptors != 1 && *descriptors != 3) {
		fmt.Fprintln(os.Stderr, "grpc_load: callers, conns and users must be >= 1; descriptors 1 or 3")
		os.Exit(2)
	}
	encoding.RegisterCodec(rawCodec{})

	// Every request encoded before the clock starts.
	names := make([]string, *users)
	for i := range names {
		names[i] = fmt.Sprintf("u%d", i)
	}
	if *user != "" {
		names = []string{*user}
	}
	requests := make([][]byte, len(names))
	for i, name := range names {
		list := [][]entry{{{"user", name}}}
		if *descriptors == 3 {
			list = append(list, []entry{{"org", fmt.Sprintf("o%d", i%50)}}, []entry{{"route", "r1"}})
		}
		requests[i] = encodeRequest(*domain, list)
	}

	connections := make([]*grpc.ClientConn, *conns)
	for i := range connections {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		conn, err := grpc.DialContext(ctx, *address, grpc.WithInsecure(), grpc.WithBlock())
		cancel()
		if err != nil {
			fmt.Fprintf(os.Stderr, "grpc_load: cannot connect to %s: %v\n", *address, err)
			os.Exit(1)
		}
		connections[i] = conn
	}

	const method = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
	var stop int32
	var ok, over, failed int64
	var firstError atomic.Value
	latencies := make([][]uint32, *callers)
	var wait sync.WaitGroup
	started := time.Now()
	for c := 0; c < *callers; c++ {
		wait.Add(1)
		go func(caller int) {
			defer wait.Done()
			conn := connections[caller%len(connections)]
			mine := make([]uint32, 0, 1<<16)
			var reply []byte
			for i := caller; atomic.LoadInt32(&stop) == 0; i++ {
				request := requests[i%len(requests)]
				began := time.Now()
				err := conn.Invoke(context.Background(), method, &request, &reply)
				mine = append(mine, uint32(time.Since(began).Microseconds()))
				if err != nil {
					atomic.AddInt64(&failed, 1)
					firstError.Store(err.Error())
					continue
				}
				switch code, err := overallCode(reply); {
				case err != nil:
					atomic.AddInt64(&failed, 1)
					firstError.Store("reply: " + err.Error())
				case code == 1:
					atomic.AddInt64(&ok, 1)
				case code == 2:
					atomic.AddInt64(&over, 1)
				default:
					atomic.AddInt64(&failed, 1)
					firstError.Store(fmt.Sprintf("overall_code %d", code))
				}
			}
			latencies[caller] = mine
		}(c)
	}
	time.Sleep(time.Duration(*seconds * float64(time.Second)))
	atomic.StoreInt32(&stop, 1)
	elapsed := time.Since(started).Seconds()
	wait.Wait()

	var all []uint32
	for _, mine := range latencies {
		all = append(all, mine...)
	}
	sort.Slice(all, func(i, j int) bool { return all[i] < all[j] })
	fmt.Printf("calls_per_s=%.0f p50_ms=%.3f p99_ms=%.3f calls=%d ok=%d over_limit=%d errors=%d\n",
		float64(len(all))/elapsed, percentile(all, 0.50), percentile(all, 0.99),
		len(all), ok, over, failed)
	if message, present := firstError.Load().(string); present {
		fmt.Fprintf(os.Stderr, "grpc_load: first error: %s\n", message)
	}
	for _, conn := range connections {
		conn.Close()
	}
}
