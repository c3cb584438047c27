// kvfleet-epp-front is the gRPC front of the kvfleet endpoint picker (EPP).
//
// It serves the picker's gRPC port (Envoy's ext_proc calls, gRPC health) and moves every call's
// messages, as their serialized bytes, to and from the picker process over one Unix socket that
// the picker hands it (a file descriptor inherited at exec). It makes no decision and decodes no
// message but the response chunks and request headers the picker asks it to answer with its own
// bytes (ECHO and AHEAD below): the picker
// (kvfleet/epp/server.py, kvfleet/epp/front.py) does both, so there is one implementation of the
// protocol. What it takes off the picker is gRPC itself: HTTP/2, flow control and the per-message work
// of Python's grpc.aio, which cost as much CPU as a decision.
//
// Frames on the socket, both ways: u32 little-endian length of what follows, u64 little-endian
// call id, u8 kind, payload.
//
//	front → picker: HELLO (call 0, payload: the bound port, decimal), OPEN (payload: the method,
//	                then the metadata as u16/u32 length-prefixed key/value pairs), MSG (a request
//	                message), HEADERS (a call's request headers answered here, below), HALF_CLOSE (the
//	                client sent its last message), CANCEL (the call ended before the picker finished it:
//	                reset by the client, or a send failed), BODY (the bodies of the response chunks
//	                answered here since the picker's last message, below)
//	picker → front: MSG (a response message), END (finish the call with OK), ERROR (payload: u32
//	                gRPC status code, then the status message), ECHO (answer the call's response-body
//	                chunks here, below), AHEAD (call 0: answer request headers here, below)
//
// AHEAD (payload: u8, the picker's default request body mode; then the picker's answer to request
// headers) saves the picker one wake-up per request. In BUFFERED mode Envoy sends a request's headers,
// waits for their answer, then sends the whole body: the answer to headers that do not end the request
// is fixed (continue), so a call's first message that is exactly such headers (request_headers with
// end_of_stream false, beside only the metadata, attributes and protocol configuration Envoy attaches;
// the body mode BUFFERED, from the protocol configuration or else the picker's default) is answered here
// with the picker's bytes, and handed to the picker as HEADERS together with the call's next frame (the
// body), in one write. The picker still checks the headers (kvfleet/epp/front.py): what it would have
// refused there (a path it does not serve, a wrong method, a declared length over its limit) it answers
// to the body instead, with the same immediate response.
//
// ECHO and AHEAD are the places the front reads a message. Envoy sends each chunk of a response (a streamed
// token each) to the picker and waits for its answer, which depends only on the body mode: in
// STREAMED an empty BodyResponse, in FULL_DUPLEX_STREAMED the chunk handed back unchanged. A round trip
// to the picker per token cost it more than its decisions, so after the pick the picker follows each
// of its answers on an inference call with ECHO (payload: u64 little-endian, the count of the call's
// messages it has answered; u32, how many bytes of the chunks' bodies it reads, the usage: 0 for a
// response it does not read, epp.response_body_sample; then the fixed answer, none for "hand the chunk
// back"). From then on a message that is exactly a response-body chunk not ending the response
// (ProcessingRequest{response_body: HttpBody{body}}, and the metadata Envoy attaches to every message)
// is answered here: the fixed answer, or the bytes of the picker's protocol.passthrough_body_response
// (tests/epp/test_front.py compares them), queued behind the picker's answers to the messages handed
// to it before (an answer made while one of those is due waits for the ECHO that follows it: Envoy
// takes a call's answers in order). The bodies the picker reads reach it as BODY ahead of its next
// message. Every other message goes to the picker: the response headers, the response's last chunk, its
// trailers, anything with a field the front does not read.
//
// The front exits when the socket closes (the picker is gone), after failing its calls with
// UNAVAILABLE, so a data plane's failure mode (failure_mode_allow, GIE's FailOpen) applies.
package main

import (
	"bufio"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
)

const (
	kindHello     = 1
	kindOpen      = 2
	kindMsg       = 3
	kindHalfClose = 4
	kindCancel    = 5
	kindEnd       = 6
	kindError     = 7
	kindEcho      = 8
	kindBody      = 9
	kindAhead     = 10
	kindHeaders   = 11

	headerLen = 4 + 8 + 1
)

// rawCodec passes messages through as bytes; it registers under "proto" so clients' content type
// (application/grpc+proto, or none) is accepted unchanged. A received message is copied once, out of
// grpc-go's pooled buffers; a sent one is not copied.
type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(*(v.(*[]byte)))}, nil
}

func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	*(v.(*[]byte)) = data.Materialize()
	return nil
}

func (rawCodec) Name() string { return "proto" }

type frame struct {
	call    uint64
	kind    byte
	payload []byte
}

// call is the front's side of one gRPC call: the picker's frames for it, in order.
type call struct {
	mu     sync.Mutex
	queue  []frame
	notify chan struct{}
	// open: the call's OPEN frame until it goes to the picker (with the call's first frame);
	// cancelled: the call ended here (its CANCEL sent, or none when the picker never heard of it)
	open      *frame
	cancelled bool
	// chunks: the response-body chunks are answered here (the picker's ECHO): with fixed (its bytes), or
	// the chunk handed back when fixed is empty; the first captureLeft bytes of their bodies are kept
	// (captured) for the picker, sent ahead of the next message it gets. forwarded: the messages handed to
	// the picker; answered: of those, the ones the latest ECHO says it has answered. An answer made here
	// while some are not waits in held (heldBytes of chunk bodies) for the ECHO that says they are.
	chunks      bool
	fixed       []byte
	captureLeft int
	captured    []byte
	forwarded   uint64
	answered    uint64
	held        []heldAnswer
	heldBytes   int
}

// heldAnswer is an answer made here that goes out once the picker has answered the first after messages.
type heldAnswer struct {
	after  uint64
	answer []byte
	bytes  int // the chunk body's, counted in heldBytes
}

// heldBudget bounds the chunk bodies of the answers a call holds; past it, chunks go to the picker.
const heldBudget = 1 << 20

// opening sends the call's OPEN frame, held until its first frame (see handle), unless the call was
// cancelled first: then it reports false and the picker never hears of the call.
func (f *front) opening(c *call) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cancelled {
		return false
	}
	if c.open != nil {
		f.send(*c.open) // under the lock: a CANCEL cannot overtake it
		c.open = nil
	}
	return true
}

// cancelling marks the call cancelled and reports whether the picker has heard of it (its OPEN sent).
func (f *front) cancelling(c *call) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.cancelled = true
	return c.open == nil
}

func (c *call) push(f frame) {
	c.mu.Lock()
	c.queue = append(c.queue, f)
	c.mu.Unlock()
	c.wake()
}

func (c *call) wake() {
	select {
	case c.notify <- struct{}{}:
	default:
	}
}

// local answers msg here, and reports true, when the call's chunks are answered here and msg is a
// response-body chunk that does not end the response. The answer queues behind the picker's answers to
// every message handed to it before (held until its ECHO says they are answered: Envoy takes a call's
// answers in order). Otherwise msg goes to the picker (counted), preceded by the chunk bodies captured
// since the last message it got (captured, the caller sends them).
func (c *call) local(msg []byte) (handled bool, captured []byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.chunks {
		if body, ok := chunk(msg); ok && (c.forwarded == c.answered || c.heldBytes+len(body) <= heldBudget) {
			answer := c.fixed
			if len(answer) == 0 {
				answer = echoAnswer(body)
			}
			if c.forwarded == c.answered {
				c.queue = append(c.queue, frame{kind: kindMsg, payload: answer})
				c.wake()
			} else {
				c.held = append(c.held, heldAnswer{after: c.forwarded, answer: answer, bytes: len(body)})
				c.heldBytes += len(body)
			}
			if c.captureLeft > 0 {
				c.captured = append(c.captured, body...)
				c.captureLeft -= len(body)
			}
			return true, nil
		}
	}
	c.forwarded++
	captured, c.captured = c.captured, nil
	return false, captured
}

// echoFrom takes an ECHO frame's payload: u64 the count of the call's messages the picker has answered,
// u32 how many bytes of the chunks' bodies to capture for it (read at the first ECHO only), then the fixed
// answer to a chunk (none: hand the chunk back). The answers held for those messages go out.
func (c *call) echoFrom(payload []byte) {
	if len(payload) < 12 {
		return
	}
	n := binary.LittleEndian.Uint64(payload)
	c.mu.Lock()
	if !c.chunks {
		c.chunks = true
		c.captureLeft = int(binary.LittleEndian.Uint32(payload[8:12]))
		c.fixed = append([]byte(nil), payload[12:]...)
	}
	if n > c.answered {
		c.answered = n
	}
	i := 0
	for ; i < len(c.held) && c.held[i].after <= c.answered; i++ {
		c.queue = append(c.queue, frame{kind: kindMsg, payload: c.held[i].answer})
		c.heldBytes -= c.held[i].bytes
	}
	if i > 0 {
		c.held = c.held[i:]
		if len(c.held) == 0 {
			c.held = nil
		}
	}
	c.mu.Unlock()
	if i > 0 {
		c.wake()
	}
}

// The ext_proc field numbers the front reads and writes (envoy/service/ext_proc/v3/external_processor.proto).
const (
	reqRequestHeaders  = 2  // ProcessingRequest.request_headers
	reqProtocolConfig  = 11 // ProcessingRequest.protocol_config
	headersMap         = 1  // HttpHeaders.headers
	headersAttributes  = 2  // HttpHeaders.attributes
	headersEndOfStream = 3  // HttpHeaders.end_of_stream
	configRequestMode  = 1  // ProtocolConfiguration.request_body_mode
	modeBuffered       = 2  // ProcessingMode.BodySendMode.BUFFERED
	reqResponseBody    = 5  // ProcessingRequest.response_body
	reqMetadataContext = 8  // ProcessingRequest.metadata_context
	reqAttributes      = 9  // ProcessingRequest.attributes
	bodyBody           = 1  // HttpBody.body
	bodyEndOfStream    = 2  // HttpBody.end_of_stream
	respResponseBody   = 4  // ProcessingResponse.response_body
	bodyRespResponse   = 1  // BodyResponse.response
	commonBodyMutation = 3  // CommonResponse.body_mutation
	mutationStreamed   = 3  // BodyMutation.streamed_response
	streamedBody       = 1  // StreamedBodyResponse.body
)

// chunk is the body of msg (a serialized ProcessingRequest) when msg is a response-body chunk that does
// not end the response: one response_body field, holding at most a body and end_of_stream false, beside
// which only the metadata and attributes Envoy attaches to every message (the picker reads neither on a
// chunk). Anything else, or a parse error: false (the picker answers it).
func chunk(msg []byte) ([]byte, bool) {
	var body []byte
	bodies := 0
	ok := requestFields(msg, func(num protowire.Number, v []byte) bool {
		if num != reqResponseBody {
			return false
		}
		bodies++
		body = v
		return true
	})
	if !ok || bodies != 1 {
		return nil, false
	}
	return chunkBody(body)
}

// requestFields walks a serialized ProcessingRequest and hands visit each field but the metadata and
// attributes Envoy attaches to every message. Every field must be length-delimited (a message): a
// varint field (observability_mode) or a parse error stops the walk with false, as does visit returning
// false.
func requestFields(msg []byte, visit func(num protowire.Number, v []byte) bool) bool {
	for len(msg) > 0 {
		num, typ, n := protowire.ConsumeTag(msg)
		if n < 0 || typ != protowire.BytesType {
			return false
		}
		v, m := protowire.ConsumeBytes(msg[n:])
		if m < 0 {
			return false
		}
		msg = msg[n+m:]
		if num != reqMetadataContext && num != reqAttributes && !visit(num, v) {
			return false
		}
	}
	return true
}

// chunkBody is an HttpBody's body when it holds nothing but the body and end_of_stream false.
func chunkBody(b []byte) ([]byte, bool) {
	var body []byte
	seen := false
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil, false
		}
		b = b[n:]
		switch {
		case num == bodyBody && typ == protowire.BytesType && !seen:
			v, m := protowire.ConsumeBytes(b)
			if m < 0 {
				return nil, false
			}
			body, b, seen = v, b[m:], true
		case num == bodyEndOfStream && typ == protowire.VarintType:
			v, m := protowire.ConsumeVarint(b)
			if m < 0 || v != 0 {
				return nil, false
			}
			b = b[m:]
		default:
			return nil, false
		}
	}
	return body, true
}

// aheadConfig is the picker's AHEAD frame: its default request body mode and its answer to request
// headers that do not end the request.
type aheadConfig struct {
	mode   uint64
	answer []byte
}

// answersAhead reports whether msg (a call's first message) is request headers the front answers with
// the picker's AHEAD bytes: request_headers with end_of_stream false, beside only the metadata and
// attributes Envoy attaches and its protocol configuration, the request body mode BUFFERED (the
// configuration's, else the picker's default). Anything else, or a parse error: false.
func answersAhead(msg []byte, defaultMode uint64) bool {
	mode := defaultMode
	headers := 0
	ok := requestFields(msg, func(num protowire.Number, v []byte) bool {
		switch num {
		case reqRequestHeaders:
			headers++
			return headersContinue(v)
		case reqProtocolConfig:
			md, ok := requestMode(v)
			mode = md
			return ok
		default: // any other message: the picker answers
			return false
		}
	})
	return ok && headers == 1 && mode == modeBuffered
}

// headersContinue reports whether an HttpHeaders message does not end the request (end_of_stream
// absent or false); an unknown field or a parse error: false.
func headersContinue(b []byte) bool {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return false
		}
		b = b[n:]
		switch {
		case num == headersEndOfStream && typ == protowire.VarintType:
			v, m := protowire.ConsumeVarint(b)
			if m < 0 || v != 0 {
				return false
			}
			b = b[m:]
		case (num == headersMap || num == headersAttributes) && typ == protowire.BytesType:
			_, m := protowire.ConsumeBytes(b)
			if m < 0 {
				return false
			}
			b = b[m:]
		default:
			return false
		}
	}
	return true
}

// requestMode is a ProtocolConfiguration's request body mode (absent: NONE, 0).
func requestMode(b []byte) (uint64, bool) {
	mode := uint64(0)
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return 0, false
		}
		m := protowire.ConsumeFieldValue(num, typ, b[n:])
		if m < 0 {
			return 0, false
		}
		if num == configRequestMode && typ == protowire.VarintType {
			mode, _ = protowire.ConsumeVarint(b[n:])
		}
		b = b[n+m:]
	}
	return mode, true
}

// echoAnswer is ProcessingResponse{response_body: {response: {body_mutation: {streamed_response:
// {body}}}}} serialized as the picker's protobuf runtime does (fields in order, an empty body omitted,
// every level present).
func echoAnswer(body []byte) []byte {
	s1 := 0
	if len(body) > 0 {
		s1 = protowire.SizeTag(streamedBody) + protowire.SizeBytes(len(body))
	}
	s2 := protowire.SizeTag(mutationStreamed) + protowire.SizeBytes(s1)
	s3 := protowire.SizeTag(commonBodyMutation) + protowire.SizeBytes(s2)
	s4 := protowire.SizeTag(bodyRespResponse) + protowire.SizeBytes(s3)
	b := make([]byte, 0, protowire.SizeTag(respResponseBody)+protowire.SizeBytes(s4))
	b = protowire.AppendTag(b, respResponseBody, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(s4))
	b = protowire.AppendTag(b, bodyRespResponse, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(s3))
	b = protowire.AppendTag(b, commonBodyMutation, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(s2))
	b = protowire.AppendTag(b, mutationStreamed, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(s1))
	if len(body) > 0 {
		b = protowire.AppendTag(b, streamedBody, protowire.BytesType)
		b = protowire.AppendBytes(b, body)
	}
	return b
}

func (c *call) pop() (frame, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.queue) == 0 {
		return frame{}, false
	}
	f := c.queue[0]
	c.queue[0] = frame{}
	c.queue = c.queue[1:]
	return f, true
}

type front struct {
	conn    net.Conn
	maxMsg  int
	nextID  atomic.Uint64
	calls   sync.Map // uint64 → *call
	out     chan frame
	dead    chan struct{}
	dieOnce sync.Once
	// payload bytes queued for the writer, at most queueBudget (one frame of any size gets through
	// alone): a picker that reads slowly holds the calls' receivers back, and gRPC's flow control
	// then holds the data plane back, instead of the front's memory growing
	srv *grpc.Server // set before the socket is read
	// the picker's AHEAD frame (nil until it comes: request headers go to the picker)
	ahead    atomic.Pointer[aheadConfig]
	queuedMu sync.Mutex
	queuedCv *sync.Cond
	queued   int
}

const queueBudget = 64 << 20

// processMethod is ext_proc's method: the one whose request headers may be answered here (AHEAD)
const processMethod = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"

func (f *front) die(why error) {
	f.dieOnce.Do(func() {
		log.Printf("kvfleet-epp-front: picker connection lost: %v", why)
		// close the listener and the connections first: a call opened from now on would reach no
		// picker, and a data plane that cannot open its stream applies its failure mode (FailOpen
		// passes the request on) where a stream it had opened and sent the body on fails the request
		if f.srv != nil {
			f.srv.Stop()
		}
		close(f.dead)
		f.queuedMu.Lock()
		f.queuedCv.Broadcast()
		f.queuedMu.Unlock()
	})
}

func (f *front) isDead() bool {
	select {
	case <-f.dead:
		return true
	default:
		return false
	}
}

// send queues a frame for the writer within the byte budget; after the picker is gone it drops it.
func (f *front) send(fr frame) {
	n := len(fr.payload)
	f.queuedMu.Lock()
	for f.queued > 0 && f.queued+n > queueBudget && !f.isDead() {
		f.queuedCv.Wait()
	}
	f.queued += n
	f.queuedMu.Unlock()
	select {
	case f.out <- fr:
	case <-f.dead:
	}
}

func (f *front) written(n int) {
	f.queuedMu.Lock()
	f.queued -= n
	f.queuedCv.Broadcast()
	f.queuedMu.Unlock()
}

// writer owns the socket's write side: it writes queued frames and flushes when the queue is empty,
// so frames from many calls share a write under load.
func (f *front) writer() {
	w := bufio.NewWriterSize(f.conn, 256<<10)
	var hdr [headerLen]byte
	for {
		var fr frame
		select {
		case fr = <-f.out:
		case <-f.dead:
			return
		}
	batch:
		for {
			binary.LittleEndian.PutUint32(hdr[0:4], uint32(9+len(fr.payload)))
			binary.LittleEndian.PutUint64(hdr[4:12], fr.call)
			hdr[12] = fr.kind
			if _, err := w.Write(hdr[:]); err != nil {
				f.die(err)
				return
			}
			if _, err := w.Write(fr.payload); err != nil {
				f.die(err)
				return
			}
			f.written(len(fr.payload))
			select {
			case fr = <-f.out:
			default:
				// let the goroutines that are about to send (a call's next message, another call's
				// answer) run before the flush, so one write carries them all
				runtime.Gosched()
				select {
				case fr = <-f.out:
				default:
					break batch
				}
			}
		}
		if err := w.Flush(); err != nil {
			f.die(err)
			return
		}
	}
}

// reader hands the picker's frames to their calls; a frame for a call that has ended is dropped.
func (f *front) reader() {
	r := bufio.NewReaderSize(f.conn, 256<<10)
	var hdr [headerLen]byte
	for {
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			f.die(err)
			return
		}
		n := binary.LittleEndian.Uint32(hdr[0:4])
		if n < 9 || int(n)-9 > f.maxMsg+64 {
			f.die(fmt.Errorf("bad frame length %d", n))
			return
		}
		fr := frame{call: binary.LittleEndian.Uint64(hdr[4:12]), kind: hdr[12], payload: make([]byte, n-9)}
		if _, err := io.ReadFull(r, fr.payload); err != nil {
			f.die(err)
			return
		}
		if fr.call == 0 && fr.kind == kindAhead {
			if len(fr.payload) > 1 {
				f.ahead.Store(&aheadConfig{mode: uint64(fr.payload[0]), answer: fr.payload[1:]})
			}
			continue
		}
		if c, ok := f.calls.Load(fr.call); ok {
			if fr.kind == kindEcho {
				c.(*call).echoFrom(fr.payload)
			} else {
				c.(*call).push(fr)
			}
		}
	}
}

func encodeOpen(method string, md metadata.MD) []byte {
	b := make([]byte, 0, 256)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(method)))
	b = append(b, method...)
	for k, vs := range md {
		if len(k) > 0xffff {
			continue
		}
		for _, v := range vs {
			b = binary.LittleEndian.AppendUint16(b, uint16(len(k)))
			b = append(b, k...)
			b = binary.LittleEndian.AppendUint32(b, uint32(len(v)))
			b = append(b, v...)
		}
	}
	return b
}

// handle serves any method: the picker answers the ones it knows and refuses the rest.
func (f *front) handle(_ any, ss grpc.ServerStream) error {
	method, ok := grpc.MethodFromServerStream(ss)
	if !ok {
		return status.Error(codes.Internal, "no method")
	}
	if len(method) > 0xffff { // no method the picker serves is as long; its frame holds a u16 length
		return status.Error(codes.Unimplemented, "unknown method")
	}
	id := f.nextID.Add(1)
	c := &call{notify: make(chan struct{}, 1)}
	f.calls.Store(id, c)
	defer f.calls.Delete(id)
	md, _ := metadata.FromIncomingContext(ss.Context())
	openFrame := frame{call: id, kind: kindOpen, payload: encodeOpen(method, md)}
	process := method == processMethod
	if process {
		// an ext_proc call's OPEN goes with its first frame: one wake-up of the picker for both
		c.open = &openFrame
	} else {
		f.send(openFrame)
	}

	recvErr := make(chan error, 1)
	go func() {
		// the call's request headers answered here (AHEAD), handed to the picker with its next frame
		var held []byte
		first := process
		opened := !process
		forward := func(fr frame) bool {
			if !opened {
				if !f.opening(c) {
					return false // cancelled before the picker heard of it
				}
				opened = true
			}
			f.send(fr)
			return true
		}
		for {
			var b []byte
			if err := ss.RecvMsg(&b); err != nil {
				if errors.Is(err, io.EOF) {
					if held != nil {
						forward(frame{call: id, kind: kindHeaders, payload: held})
					}
					forward(frame{call: id, kind: kindHalfClose})
					err = nil
				}
				recvErr <- err
				return
			}
			if first {
				first = false
				if cfg := f.ahead.Load(); cfg != nil && answersAhead(b, cfg.mode) {
					held = b
					c.push(frame{kind: kindMsg, payload: cfg.answer})
					continue
				}
			}
			if held != nil {
				if !forward(frame{call: id, kind: kindHeaders, payload: held}) {
					recvErr <- nil
					return
				}
				held = nil
			}
			handled, captured := c.local(b)
			if handled {
				continue
			}
			if len(captured) > 0 {
				forward(frame{call: id, kind: kindBody, payload: captured})
			}
			if !forward(frame{call: id, kind: kindMsg, payload: b}) {
				recvErr <- nil
				return
			}
		}
	}()
	cancel := func(err error) error {
		if f.cancelling(c) {
			f.send(frame{call: id, kind: kindCancel})
		}
		return err
	}
	for {
		select {
		case <-c.notify:
			for {
				fr, ok := c.pop()
				if !ok {
					break
				}
				switch fr.kind {
				case kindMsg:
					if err := ss.SendMsg(&fr.payload); err != nil {
						return cancel(err)
					}
				case kindEnd:
					return nil
				case kindError:
					code := codes.Unknown
					msg := ""
					if len(fr.payload) >= 4 {
						code = codes.Code(binary.LittleEndian.Uint32(fr.payload[:4]))
						msg = string(fr.payload[4:])
					}
					return status.Error(code, msg)
				}
			}
		case err := <-recvErr:
			if err != nil {
				return cancel(err)
			}
			recvErr = nil
		case <-ss.Context().Done():
			return cancel(ss.Context().Err())
		case <-f.dead:
			return status.Error(codes.Unavailable, "the endpoint picker process is gone")
		}
	}
}

func main() {
	fd := flag.Int("fd", -1, "the inherited Unix socket to the picker process")
	listen := flag.String("listen", "0.0.0.0:9002", "host:port to serve gRPC on (port 0: any free port)")
	maxMsg := flag.Int("max-message-bytes", 64<<20, "the largest gRPC message accepted or sent")
	cert := flag.String("tls-cert-file", "", "serve TLS with this certificate (with --tls-key-file)")
	key := flag.String("tls-key-file", "", "the TLS certificate's private key")
	grace := flag.Duration("grace", 500*time.Millisecond, "on SIGTERM, how long calls in flight may go on")
	flag.Parse()
	log.SetFlags(log.LstdFlags | log.Lmicroseconds)
	if os.Getenv("GOGC") == "" {
		// its live heap is a few MB and every large body passes through it: collect less often
		debug.SetGCPercent(400)
	}
	if os.Getenv("GOMAXPROCS") == "" {
		// one OS thread runs the goroutines: a front does ≈ 0.1-0.3 ms of work per call, and idle
		// processors spinning for work cost more CPU than they save here (measured: docs/epp.md)
		runtime.GOMAXPROCS(1)
	}
	if *fd < 0 {
		log.Fatal("kvfleet-epp-front: --fd is required (the picker process starts this program)")
	}
	conn, err := net.FileConn(os.NewFile(uintptr(*fd), "picker"))
	if err != nil {
		log.Fatalf("kvfleet-epp-front: --fd %d: %v", *fd, err)
	}
	encoding.RegisterCodecV2(rawCodec{})
	f := &front{conn: conn, maxMsg: *maxMsg, out: make(chan frame, 1024), dead: make(chan struct{})}
	f.queuedCv = sync.NewCond(&f.queuedMu)
	opts := []grpc.ServerOption{
		grpc.ForceServerCodecV2(rawCodec{}),
		grpc.UnknownServiceHandler(f.handle),
		grpc.MaxRecvMsgSize(*maxMsg),
		grpc.MaxSendMsgSize(*maxMsg),
		grpc.ReadBufferSize(256 << 10),
		grpc.WriteBufferSize(256 << 10),
		grpc.InitialWindowSize(4 << 20),
		grpc.InitialConnWindowSize(16 << 20),
	}
	if *cert != "" || *key != "" {
		creds, err := credentials.NewServerTLSFromFile(*cert, *key)
		if err != nil {
			log.Fatalf("kvfleet-epp-front: TLS: %v", err)
		}
		opts = append(opts, grpc.Creds(creds))
	}
	lis, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatalf("kvfleet-epp-front: listen %s: %v", *listen, err)
	}
	srv := grpc.NewServer(opts...)
	f.srv = srv
	// KVFLEET_EPP_FRONT_CPUPROFILE=PATH writes a Go CPU profile (go tool pprof) when the front stops.
	if path := os.Getenv("KVFLEET_EPP_FRONT_CPUPROFILE"); path != "" {
		if out, err := os.Create(path); err == nil && pprof.StartCPUProfile(out) == nil {
			defer pprof.StopCPUProfile()
		}
	}
	go f.writer()
	go f.reader()
	port := lis.Addr().(*net.TCPAddr).Port
	f.send(frame{call: 0, kind: kindHello, payload: []byte(strconv.Itoa(port))})
	go func() {
		if err := srv.Serve(lis); err != nil {
			log.Printf("kvfleet-epp-front: serve: %v", err)
			f.die(err)
		}
	}()
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	select {
	case <-f.dead:
		srv.Stop()
		pprof.StopCPUProfile()
		os.Exit(1)
	case s := <-sig:
		// no new calls; the calls in flight get --grace to finish (the picker answers them meanwhile)
		log.Printf("kvfleet-epp-front: %v: stopping (grace %v)", s, *grace)
		done := make(chan struct{})
		go func() {
			srv.GracefulStop()
			close(done)
		}()
		select {
		case <-done:
		case <-time.After(*grace):
			srv.Stop()
		case <-f.dead:
			srv.Stop()
		}
	}
}
