package main

// The front's hand-written wire reading and writing (chunk, answersAhead, echoAnswer) against Envoy's own
// ext_proc types from go-control-plane: the field numbers are pinned by the generated code, and the fuzz
// targets check, on any bytes, that the front only takes over a message the real decoder reads the same
// way (go test runs each target's seed corpus; `go test -fuzz=^FuzzChunk$` explores).

import (
	"bytes"
	"slices"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	procmode "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/structpb"
)

var canonical = proto.MarshalOptions{Deterministic: true}

func marshal(t testing.TB, m proto.Message) []byte {
	t.Helper()
	b, err := canonical.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// what Envoy attaches to every message (metadata and attributes), which the front skips
func withContext(m *extproc.ProcessingRequest) *extproc.ProcessingRequest {
	s, _ := structpb.NewStruct(map[string]any{"request.path": "/v1/completions"})
	m.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"envoy.lb": s}}
	m.Attributes = map[string]*structpb.Struct{"envoy.filters.http.ext_proc": s}
	return m
}

func headers(eos bool) *extproc.HttpHeaders {
	return &extproc.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
			{Key: ":path", RawValue: []byte("/v1/completions")}, {Key: ":method", RawValue: []byte("POST")}}},
		EndOfStream: eos,
	}
}

func config(mode procmode.ProcessingMode_BodySendMode) *extproc.ProtocolConfiguration {
	return &extproc.ProtocolConfiguration{RequestBodyMode: mode, ResponseBodyMode: procmode.ProcessingMode_STREAMED}
}

func reqHeaders(h *extproc.HttpHeaders, cfg *extproc.ProtocolConfiguration) *extproc.ProcessingRequest {
	return &extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestHeaders{RequestHeaders: h},
		ProtocolConfig: cfg}
}

func respBody(body []byte, eos bool) *extproc.ProcessingRequest {
	return &extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseBody{
		ResponseBody: &extproc.HttpBody{Body: body, EndOfStream: eos}}}
}

const (
	buffered = uint64(procmode.ProcessingMode_BUFFERED)
	streamed = uint64(procmode.ProcessingMode_STREAMED)
)

func TestFieldNumbers(t *testing.T) {
	if modeBuffered != buffered {
		t.Fatalf("BUFFERED is %d in ext_proc, %d here", buffered, modeBuffered)
	}
	fields := func(m proto.Message) map[string]int {
		out := map[string]int{}
		fs := m.ProtoReflect().Descriptor().Fields()
		for i := 0; i < fs.Len(); i++ {
			out[string(fs.Get(i).Name())] = int(fs.Get(i).Number())
		}
		return out
	}
	for _, c := range []struct {
		msg   proto.Message
		field string
		here  int
	}{
		{&extproc.ProcessingRequest{}, "request_headers", reqRequestHeaders},
		{&extproc.ProcessingRequest{}, "response_body", reqResponseBody},
		{&extproc.ProcessingRequest{}, "metadata_context", reqMetadataContext},
		{&extproc.ProcessingRequest{}, "attributes", reqAttributes},
		{&extproc.ProcessingRequest{}, "protocol_config", reqProtocolConfig},
		{&extproc.HttpHeaders{}, "headers", headersMap},
		{&extproc.HttpHeaders{}, "attributes", headersAttributes},
		{&extproc.HttpHeaders{}, "end_of_stream", headersEndOfStream},
		{&extproc.ProtocolConfiguration{}, "request_body_mode", configRequestMode},
		{&extproc.HttpBody{}, "body", bodyBody},
		{&extproc.HttpBody{}, "end_of_stream", bodyEndOfStream},
		{&extproc.ProcessingResponse{}, "response_body", respResponseBody},
		{&extproc.BodyResponse{}, "response", bodyRespResponse},
		{&extproc.CommonResponse{}, "body_mutation", commonBodyMutation},
		{&extproc.BodyMutation{}, "streamed_response", mutationStreamed},
		{&extproc.StreamedBodyResponse{}, "body", streamedBody},
	} {
		name := string(c.msg.ProtoReflect().Descriptor().Name())
		if got, ok := fields(c.msg)[c.field]; !ok || got != c.here {
			t.Errorf("%s.%s: field %d in ext_proc (present %v), %d here", name, c.field, got, ok, c.here)
		}
	}
}

func TestAnswersAhead(t *testing.T) {
	h := func(eos bool, cfg *extproc.ProtocolConfiguration) []byte {
		return marshal(t, reqHeaders(headers(eos), cfg))
	}
	for _, c := range []struct {
		name string
		msg  []byte
		mode uint64
		want bool
	}{
		{"buffered by default", h(false, nil), buffered, true},
		{"buffered by default, with Envoy's context", marshal(t, withContext(reqHeaders(headers(false), nil))), buffered, true},
		{"buffered by its configuration", h(false, config(procmode.ProcessingMode_BUFFERED)), streamed, true},
		{"streamed by default", h(false, nil), streamed, false},
		{"streamed by its configuration", h(false, config(procmode.ProcessingMode_STREAMED)), buffered, false},
		{"a configuration without a request mode (NONE)", h(false, &extproc.ProtocolConfiguration{}), buffered, false},
		{"full duplex", h(false, config(procmode.ProcessingMode_FULL_DUPLEX_STREAMED)), buffered, false},
		{"headers that end the request", h(true, nil), buffered, false},
		{"observability mode", marshal(t, &extproc.ProcessingRequest{
			Request: &extproc.ProcessingRequest_RequestHeaders{RequestHeaders: headers(false)}, ObservabilityMode: true}), buffered, false},
		{"response headers", marshal(t, &extproc.ProcessingRequest{
			Request: &extproc.ProcessingRequest_ResponseHeaders{ResponseHeaders: headers(false)}}), buffered, false},
		{"a request body", marshal(t, &extproc.ProcessingRequest{
			Request: &extproc.ProcessingRequest_RequestBody{RequestBody: &extproc.HttpBody{Body: []byte("{}")}}}), buffered, false},
		{"empty", nil, buffered, false},
	} {
		if got := answersAhead(c.msg, c.mode); got != c.want {
			t.Errorf("%s: answersAhead %v, want %v", c.name, got, c.want)
		}
	}
}

func TestChunk(t *testing.T) {
	for _, c := range []struct {
		name string
		msg  []byte
		body []byte
		want bool
	}{
		{"a chunk", marshal(t, respBody([]byte("data: {}\n\n"), false)), []byte("data: {}\n\n"), true},
		{"a chunk with Envoy's context", marshal(t, withContext(respBody([]byte("x"), false))), []byte("x"), true},
		{"an empty chunk", marshal(t, respBody(nil, false)), nil, true},
		{"the last chunk", marshal(t, respBody([]byte("x"), true)), nil, false},
		{"a request body", marshal(t, &extproc.ProcessingRequest{
			Request: &extproc.ProcessingRequest_RequestBody{RequestBody: &extproc.HttpBody{Body: []byte("x")}}}), nil, false},
		{"a chunk in observability mode", marshal(t, &extproc.ProcessingRequest{
			Request:           &extproc.ProcessingRequest_ResponseBody{ResponseBody: &extproc.HttpBody{Body: []byte("x")}},
			ObservabilityMode: true}), nil, false},
	} {
		body, ok := chunk(c.msg)
		if ok != c.want || !bytes.Equal(body, c.body) {
			t.Errorf("%s: chunk %q %v, want %q %v", c.name, body, ok, c.body, c.want)
		}
	}
}

func echoReference(body []byte) *extproc.ProcessingResponse {
	return &extproc.ProcessingResponse{Response: &extproc.ProcessingResponse_ResponseBody{ResponseBody: &extproc.BodyResponse{
		Response: &extproc.CommonResponse{BodyMutation: &extproc.BodyMutation{
			Mutation: &extproc.BodyMutation_StreamedResponse{StreamedResponse: &extproc.StreamedBodyResponse{Body: body}}}}}}}
}

func FuzzEchoAnswer(f *testing.F) {
	for _, b := range [][]byte{nil, []byte("x"), []byte("data: {\"choices\":[]}\n\n"), bytes.Repeat([]byte("y"), 70000)} {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		if got, want := echoAnswer(body), marshal(t, echoReference(body)); !bytes.Equal(got, want) {
			t.Fatalf("echoAnswer(%d bytes) differs from ext_proc's encoding", len(body))
		}
	})
}

// seeds: every message of the tables above and some near misses
func seeds(f *testing.F) [][]byte {
	var out [][]byte
	for _, m := range []*extproc.ProcessingRequest{
		reqHeaders(headers(false), nil), reqHeaders(headers(true), nil),
		reqHeaders(headers(false), config(procmode.ProcessingMode_BUFFERED)),
		reqHeaders(headers(false), config(procmode.ProcessingMode_STREAMED)),
		withContext(reqHeaders(headers(false), config(procmode.ProcessingMode_BUFFERED))),
		respBody([]byte("data: x\n\n"), false), respBody(nil, false), respBody([]byte("x"), true),
		withContext(respBody([]byte("y"), false)),
		{Request: &extproc.ProcessingRequest_ResponseBody{ResponseBody: &extproc.HttpBody{Body: []byte("z"), GrpcMessageCompressed: true}}},
		{Request: &extproc.ProcessingRequest_ResponseBody{ResponseBody: &extproc.HttpBody{EndOfStreamWithoutMessage: true}}},
		{Request: &extproc.ProcessingRequest_RequestHeaders{RequestHeaders: headers(false)}, FlowControlInit: &extproc.ProcessingRequest_FlowControlInit{}},
	} {
		out = append(out, marshal(f, m))
	}
	// non-canonical encodings the decoder merges: a field twice, end_of_stream written out as 0 or 1 after 0
	twice := append(marshal(f, reqHeaders(headers(false), nil)), marshal(f, reqHeaders(headers(true), nil))...)
	eos0 := marshal(f, respBody([]byte("x"), false))
	eos0 = append(eos0[:1:1], append([]byte{eos0[1] + 2}, append(eos0[2:], 0x10, 0x00)...)...)
	return append(out, twice, eos0, []byte{0x12, 0x00}, []byte{0x2a, 0x02, 0x10, 0x01})
}

// canonicalOf reports whether msg is the deterministic encoding of what it decodes to (the decoded form
// then has a single reading: the front must take it over exactly when the reference rule does).
func canonicalOf(msg []byte, m proto.Message) bool {
	b, err := canonical.Marshal(m)
	return err == nil && bytes.Equal(b, msg)
}

// only reports whether m sets no field but those named (and no unknown field).
func only(m proto.Message, names ...string) bool {
	ok := len(m.ProtoReflect().GetUnknown()) == 0
	m.ProtoReflect().Range(func(fd protoreflect.FieldDescriptor, _ protoreflect.Value) bool {
		ok = ok && slices.Contains(names, string(fd.Name()))
		return ok
	})
	return ok
}

func FuzzAnswersAhead(f *testing.F) {
	for _, s := range seeds(f) {
		f.Add(s, buffered)
		f.Add(s, streamed)
	}
	f.Fuzz(func(t *testing.T, msg []byte, defaultMode uint64) {
		got := answersAhead(msg, defaultMode)
		var m extproc.ProcessingRequest
		if err := proto.Unmarshal(msg, &m); err != nil {
			// undecodable: the front may still have answered (it reads only the fields it needs); the picker
			// then fails the call when it decodes the headers, as grpc.aio fails it on receipt
			return
		}
		h := m.GetRequestHeaders()
		mode := defaultMode
		if m.ProtocolConfig != nil {
			mode = uint64(m.ProtocolConfig.RequestBodyMode)
		}
		want := h != nil && only(h, "headers", "attributes", "end_of_stream") && !h.EndOfStream && mode == buffered && only(&m, "request_headers", "metadata_context", "attributes", "protocol_config")
		if got && !want {
			t.Fatalf("answered ahead, but ext_proc decodes %v (default mode %d)", &m, defaultMode)
		}
		if !got && want && canonicalOf(msg, &m) {
			t.Fatalf("not answered ahead: %v (default mode %d)", &m, defaultMode)
		}
	})
}

// withoutContext is msg without Envoy's metadata and attributes (fields the front skips unread); nil when
// msg does not parse as a sequence of fields.
func withoutContext(msg []byte) []byte {
	out := []byte{}
	for len(msg) > 0 {
		num, typ, n := protowire.ConsumeTag(msg)
		if n < 0 {
			return nil
		}
		m := protowire.ConsumeFieldValue(num, typ, msg[n:])
		if m < 0 {
			return nil
		}
		if num != reqMetadataContext && num != reqAttributes {
			out = append(out, msg[:n+m]...)
		}
		msg = msg[n+m:]
	}
	return out
}

func FuzzChunk(f *testing.F) {
	for _, s := range seeds(f) {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, msg []byte) {
		body, got := chunk(msg)
		var m extproc.ProcessingRequest
		if err := proto.Unmarshal(msg, &m); err != nil {
			// the front answers a chunk without the picker decoding it: only Envoy's context, which the
			// picker never reads on a chunk, may be what does not decode
			if got {
				if err := proto.Unmarshal(withoutContext(msg), &m); err != nil {
					t.Fatalf("taken as a chunk, but ext_proc cannot decode it: %v", err)
				}
			} else {
				return
			}
		}
		b := m.GetResponseBody()
		want := b != nil && only(b, "body", "end_of_stream") && !b.EndOfStream && only(&m, "response_body", "metadata_context", "attributes")
		if got && !want {
			t.Fatalf("taken as a chunk, but ext_proc decodes %v", &m)
		}
		if got && !bytes.Equal(body, b.Body) {
			t.Fatalf("chunk body %q, ext_proc decodes %q", body, b.Body)
		}
		if !got && want && canonicalOf(msg, &m) {
			t.Fatalf("not taken as a chunk: %v", &m)
		}
	})
}
