package affinity

import (
	"bytes"
	"encoding/binary"
	"math"
	"strings"
	"unicode/utf16"
	"unicode/utf8"
)

// Shape is the API a request body is read as, from its path.
type Shape uint8

const (
	ShapeNone       Shape = iota // an unknown path: not read
	ShapeChat                    // OpenAI /v1/chat/completions
	ShapeCompletion              // OpenAI /v1/completions
	ShapeGenerate                // SGLang /generate
)

// ShapeOf names the API of a request path. It matches the path's end, so a prefix added in front of
// the API (a route, a rewrite) still matches.
func ShapeOf(path string) Shape {
	switch {
	case strings.HasSuffix(path, "/v1/chat/completions"):
		return ShapeChat
	case strings.HasSuffix(path, "/v1/completions"):
		return ShapeCompletion
	case strings.HasSuffix(path, "/generate"):
		return ShapeGenerate
	}
	return ShapeNone
}

// Request is what a body says about the request's size and prefix. Fields the body does not carry
// stay zero.
type Request struct {
	Shape Shape
	// PromptTokens estimates the prompt in the simulator's measure: a token per 4 bytes of prompt text
	// (rounded up, at least 1), or a token per token id. Text is measured as sent, less a byte per
	// backslash: exact for the two-byte escapes but \\ (see parser.str). Chat counts message contents,
	// not roles, and its tool definitions (tools, functions) at the length of their JSON as sent. When
	// the head is cut inside the prompt, the bytes past the head (from the content length, when known)
	// count as prompt text at the same rate, unless it is cut inside a value that is not text, such as
	// a part's base64 image. Media tokens are not counted.
	PromptTokens int64
	// MaxTokens is max_tokens (else max_completion_tokens) for OpenAI bodies and
	// sampling_params.max_new_tokens for /generate; 0 when absent, negative or not an integer.
	MaxTokens int64
	// Stream is the body's "stream": true.
	Stream bool
	// DeclaredPromptTokens is a top-level integer "prompt_tokens", which the simulator takes as the exact
	// prompt size (benchmarks use it to send sizes without building large prompts); 0 when absent.
	DeclaredPromptTokens int64
	// Continues says that a chat's messages hold an assistant turn: the conversation has sent before,
	// and will likely send again.
	Continues bool
	// SharedBlocks is how many of Blocks lie whole within a chat's leading system (or developer)
	// messages: the application's instructions, the same in each of its requests.
	SharedBlocks int
	// PreviousBlocks is how many of Blocks lie whole before a chat's last assistant message: the prompt
	// of the conversation's previous request, which an index that saw that request sent knows.
	PreviousBlocks int
	// Blocks is the key: the chained hashes of the prompt's whole leading blocks (see BlockBytes). Parse
	// fills at most cap(Blocks) of them into the caller's backing array, so give it capacity (MaxBlocks)
	// once and keep it: Parse allocates nothing. Chat messages are keyed as role, 0, content, 0 for each
	// message in order (parts' texts concatenated), behind the tool definitions' JSON as sent, each
	// followed by 0, wherever they stand in the body: the chat template writes them ahead of the
	// messages, so two applications' requests share no prefix, whatever their messages, unless their
	// tools are the same. /v1/completions and /generate key the prompt text,
	// or the token ids as 4-byte little-endian integers. Text is keyed as sent, escapes included: one
	// client's encoder spells one prompt one way every time, and hashing the bytes as they are costs
	// nothing per character.
	Blocks []uint64

	// whole is the body that ReadRequest hands on in memory, read whole: here so that it costs no
	// allocation of its own, it lives as long as the Request. Parse leaves it as it is.
	whole bytes.Reader
}

// Parse reads the request fields from head, the first bytes of the body of a request to path;
// complete says head is the whole body, contentLength is the body's length (-1 when unknown). A body
// that is not JSON, or an unknown path, leaves dst zero but for the capacity of dst.Blocks.
func Parse(path string, head []byte, complete bool, contentLength int64, dst *Request) {
	blocks := dst.Blocks[:0]
	*dst = Request{Blocks: blocks, whole: dst.whole}
	shape := ShapeOf(path)
	if shape == ShapeNone {
		return
	}
	p := parser{s: head, shape: shape, messagesAt: -1}
	p.key.reset(seedText, blocks)
	p.object(topObject)
	if p.bad || p.cut && complete {
		return
	}
	if p.defsBytes() > 0 {
		p.keyBehindDefs()
	}
	dst.Shape = shape
	dst.Stream = p.stream
	dst.Continues = p.continues
	dst.SharedBlocks = p.sharedBlocks
	dst.PreviousBlocks = p.previousBlocks
	dst.DeclaredPromptTokens = max(0, p.declared)
	switch {
	case shape == ShapeGenerate:
		dst.MaxTokens = p.maxNew
	case p.hasMax:
		dst.MaxTokens = p.maxTokens
	default:
		dst.MaxTokens = p.maxCompletion
	}
	dst.MaxTokens = max(0, dst.MaxTokens)
	if p.prompt != promptNone {
		rest := int64(0)
		if p.cutInPrompt && contentLength > int64(len(head)) {
			rest = contentLength - int64(len(head))
		}
		if p.prompt == promptIDs {
			if rest > 0 && p.idBytes > 0 {
				p.ids += rest * p.ids / p.idBytes
			}
			dst.PromptTokens = max(1, p.ids)
		} else {
			dst.PromptTokens = max(1, (p.text+p.defsBytes()+rest+bytesPerToken-1)/bytesPerToken)
		}
	}
	dst.Blocks = p.key.blocks
}

type promptKind uint8

const (
	promptNone promptKind = iota
	promptText
	promptIDs
)

// parser scans just the fields Parse needs and skips the rest. Every method that scans returns false
// when scanning must stop: at the end of the head (cut) or at a syntax error (bad).
type parser struct {
	s     []byte
	i     int
	shape Shape
	cut   bool // the head ended inside the document
	bad   bool // not JSON
	// cutInPrompt: the head ended inside the prompt, so what follows is more of it.
	cutInPrompt bool
	inPrompt    bool
	// skipping: inside a value the parser skips, such as a part's base64 image or audio, which says
	// nothing of how much prompt text follows it.
	skipping bool

	key     keyWriter
	prompt  promptKind
	genText bool  // /generate had a text string, which wins over input_ids
	text    int64 // prompt text bytes, as sent less a byte per backslash
	ids     int64 // token ids
	idBytes int64 // bytes of JSON the ids took, to estimate ids past the head

	// defs are a chat's tool definitions, tools and then functions as the chat template writes them:
	// where their JSON lies in s (end == start when absent or null); messagesAt is where the messages'
	// value starts (-1 when not seen), to key them behind the defs.
	defs       [2]span
	messagesAt int

	stream                           bool
	declared                         int64
	maxTokens, maxCompletion, maxNew int64
	hasMax                           bool
	msgRole, msgContent              int      // positions in a message object, -1 when not seen
	msgOpened                        bool     // the message's role and separator are keyed
	msgSystem                        bool     // the message's role is "system" or "developer"
	continues                        bool     // a message had the role "assistant"
	leading                          bool     // every message so far was a system message
	sharedBlocks                     int      // whole blocks keyed by the leading system messages
	previousBlocks                   int      // whole blocks keyed before the last assistant message
	keyBuf                           [32]byte // a key with escapes, decoded
}

func (p *parser) end() bool {
	p.cut = true
	if p.inPrompt && !p.skipping {
		p.cutInPrompt = true
	}
	return false
}

func (p *parser) fail() bool {
	p.bad = true
	return false
}

func (p *parser) ws() {
	for p.i < len(p.s) {
		switch p.s[p.i] {
		case ' ', '\t', '\n', '\r':
			p.i++
		default:
			return
		}
	}
}

// next skips whitespace and reports whether a byte follows.
func (p *parser) next() bool {
	p.ws()
	return p.i < len(p.s) || p.end()
}

// The objects and arrays Parse looks into, by what their fields or elements are. A switch rather
// than function values, so the parser stays on the stack.
type container uint8

const (
	topObject container = iota
	samplingObject
	messageObject
	partObject
	idsArray
	textsArray
	messagesArray
	partsArray
)

func (p *parser) field(c container, key []byte) bool {
	switch c {
	case topObject:
		return p.topField(key)
	case samplingObject:
		return p.samplingField(key)
	case messageObject:
		return p.messageField(key)
	default:
		return p.partField(key)
	}
}

func (p *parser) elem(c container) bool {
	switch c {
	case idsArray:
		return p.tokenID()
	case textsArray:
		return p.textOrSkip()
	case messagesArray:
		return p.message()
	default:
		return p.part()
	}
}

// object walks the object at p.i, calling field with each key (decoded, or nil when too long to be
// one we read) with p.i at its value; field must consume the value.
func (p *parser) object(c container) bool {
	if !p.next() {
		return false
	}
	if p.s[p.i] != '{' {
		return p.fail()
	}
	p.i++
	for first := true; ; first = false {
		if !p.next() {
			return false
		}
		if p.s[p.i] == '}' && first {
			p.i++
			return true
		}
		if p.s[p.i] != '"' {
			return p.fail()
		}
		key, ok := p.keyName()
		if !ok || !p.next() {
			return false
		}
		if p.s[p.i] != ':' {
			return p.fail()
		}
		p.i++
		if !p.next() || !p.field(c, key) || !p.next() {
			return false
		}
		switch p.s[p.i] {
		case ',':
			p.i++
		case '}':
			p.i++
			return true
		default:
			return p.fail()
		}
	}
}

// array walks the array at p.i, calling elem with p.i at each element; elem must consume it.
func (p *parser) array(c container) bool {
	if p.s[p.i] != '[' {
		return p.fail()
	}
	p.i++
	for first := true; ; first = false {
		if !p.next() {
			return false
		}
		if p.s[p.i] == ']' && first {
			p.i++
			return true
		}
		if !p.elem(c) || !p.next() {
			return false
		}
		switch p.s[p.i] {
		case ',':
			p.i++
		case ']':
			p.i++
			return true
		default:
			return p.fail()
		}
	}
}

// keyName reads an object key. Keys with escapes are decoded into p.keyBuf; a longer key is returned
// as nil, since no key Parse reads is that long.
func (p *parser) keyName() ([]byte, bool) {
	buf := &p.keyBuf
	start := p.i + 1
	if !p.skipString() {
		return nil, false
	}
	raw := p.s[start : p.i-1]
	if bytes.IndexByte(raw, '\\') < 0 {
		return raw, true
	}
	n := 0
	for i := 0; i < len(raw); {
		var r [4]byte
		k, next := 1, i+1
		if raw[i] == '\\' {
			var ok bool
			if k, next, ok = unescape(raw, i, &r); !ok {
				return nil, p.fail()
			}
		} else {
			r[0] = raw[i]
		}
		if n+k > len(buf) {
			return nil, true
		}
		n += copy(buf[n:], r[:k])
		i = next
	}
	return buf[:n], true
}

func (p *parser) topField(key []byte) bool {
	switch string(key) {
	case "stream":
		return p.boolean(&p.stream)
	case "prompt_tokens":
		return p.integer(&p.declared, nil)
	}
	switch p.shape {
	case ShapeChat:
		switch string(key) {
		case "messages":
			p.messagesAt = p.i
			return p.promptValue(p.messages)
		case "tools":
			return p.toolDefs(&p.defs[0])
		case "functions":
			return p.toolDefs(&p.defs[1])
		case "max_tokens":
			return p.integer(&p.maxTokens, &p.hasMax)
		case "max_completion_tokens":
			return p.integer(&p.maxCompletion, nil)
		}
	case ShapeCompletion:
		switch string(key) {
		case "prompt":
			return p.promptValue(p.completionPrompt)
		case "max_tokens":
			return p.integer(&p.maxTokens, &p.hasMax)
		}
	case ShapeGenerate:
		switch string(key) {
		case "text":
			if p.s[p.i] == '"' {
				p.genText = true
				return p.promptValue(p.textPrompt)
			}
		case "input_ids":
			if !p.genText {
				return p.promptValue(p.idsPrompt)
			}
		case "sampling_params":
			if p.s[p.i] == '{' {
				return p.object(samplingObject)
			}
		}
	}
	return p.skipValue()
}

func (p *parser) samplingField(key []byte) bool {
	if string(key) == "max_new_tokens" {
		return p.integer(&p.maxNew, nil)
	}
	return p.skipValue()
}

// promptValue scans the prompt's value with scan, starting the key and counts afresh (a later prompt
// field replaces an earlier one).
func (p *parser) promptValue(scan func() bool) bool {
	p.key.reset(seedText, p.key.blocks)
	p.prompt, p.text, p.ids, p.idBytes = promptNone, 0, 0, 0
	p.inPrompt = true
	ok := scan()
	p.inPrompt = false
	return ok
}

func (p *parser) textPrompt() bool {
	p.prompt = promptText
	return p.str(true, true)
}

func (p *parser) idsPrompt() bool {
	if p.s[p.i] != '[' {
		return p.skipValue()
	}
	p.prompt = promptIDs
	p.key.reset(seedIDs, p.key.blocks)
	return p.array(idsArray)
}

func (p *parser) tokenID() bool {
	start := p.i
	var id int64
	if !p.integer(&id, nil) {
		return false
	}
	var b [4]byte
	binary.LittleEndian.PutUint32(b[:], uint32(id))
	p.key.write(b[:])
	p.ids++
	p.idBytes += int64(p.i-start) + 1 // and its comma
	return true
}

// completionPrompt is a string, a list of strings (keyed as one text), or a list of token ids.
func (p *parser) completionPrompt() bool {
	switch p.s[p.i] {
	case '"':
		return p.textPrompt()
	case '[':
		j := p.i + 1
		for j < len(p.s) && (p.s[j] == ' ' || p.s[j] == '\t' || p.s[j] == '\n' || p.s[j] == '\r') {
			j++
		}
		if j < len(p.s) && (p.s[j] == '-' || p.s[j] >= '0' && p.s[j] <= '9') {
			return p.idsPrompt()
		}
		p.prompt = promptText
		return p.array(textsArray)
	}
	return p.skipValue()
}

func (p *parser) textOrSkip() bool {
	if p.s[p.i] == '"' {
		return p.str(true, true)
	}
	return p.skipValue()
}

func (p *parser) messages() bool {
	if p.s[p.i] != '[' {
		return p.skipValue()
	}
	p.prompt, p.leading = promptText, true
	return p.array(messagesArray)
}

// message keys one chat message as role, 0, content, 0 whatever the order of its fields.
func (p *parser) message() bool {
	if p.s[p.i] != '{' {
		p.leading = false
		return p.skipValue()
	}
	p.msgRole, p.msgContent, p.msgOpened, p.msgSystem = -1, -1, false, false
	ok := p.object(messageObject)
	if p.bad {
		return false
	}
	if !p.msgOpened {
		if !p.openMessage() {
			return false
		}
		if p.msgContent >= 0 {
			save := p.i
			p.i = p.msgContent
			contentOK := p.content()
			p.i = save
			if !contentOK {
				return false
			}
		}
	}
	p.key.writeByte(0)
	if ok && p.leading {
		if p.msgSystem {
			p.sharedBlocks = len(p.key.blocks)
		} else {
			p.leading = false
		}
	}
	return ok
}

func (p *parser) messageField(key []byte) bool {
	switch string(key) {
	case "role":
		if p.s[p.i] == '"' && !p.msgOpened {
			p.msgRole = p.i
		}
	case "content":
		if p.msgOpened {
			break
		}
		if p.msgRole < 0 { // role comes later: key the content once it is known
			p.msgContent = p.i
			break
		}
		if !p.openMessage() {
			return false
		}
		return p.content()
	}
	return p.skipValue()
}

// Roles, as sent: a model's answer, and the application's instructions (OpenAI's newer name for them
// is developer).
var (
	assistantRole = []byte(`"assistant"`)
	systemRole    = []byte(`"system"`)
	developerRole = []byte(`"developer"`)
)

// openMessage keys the message's role and its separator.
func (p *parser) openMessage() bool {
	p.msgOpened = true
	if p.msgRole >= 0 {
		role := p.s[p.msgRole:]
		if bytes.HasPrefix(role, assistantRole) {
			p.continues, p.previousBlocks = true, len(p.key.blocks)
		}
		p.msgSystem = bytes.HasPrefix(role, systemRole) || bytes.HasPrefix(role, developerRole)
		save := p.i
		p.i = p.msgRole
		ok := p.str(true, false)
		p.i = save
		if !ok {
			return false
		}
	}
	p.key.writeByte(0)
	return true
}

// content is a string or a list of parts whose texts count.
func (p *parser) content() bool {
	switch p.s[p.i] {
	case '"':
		return p.str(true, true)
	case '[':
		return p.array(partsArray)
	}
	return p.skipValue()
}

func (p *parser) part() bool {
	if p.s[p.i] != '{' {
		return p.skipValue()
	}
	return p.object(partObject)
}

func (p *parser) partField(key []byte) bool {
	if string(key) == "text" {
		return p.textOrSkip()
	}
	return p.skipValue()
}

// span is where a value lies in the head, s[start:end], and whether it lies there whole.
type span struct {
	start, end int
	whole      bool
}

// toolDefs records the tool definitions at p.i in d, a later field replacing an earlier one, and
// counts their JSON as sent as prompt text: a head that ends inside them ends inside the prompt. As
// the simulator takes them: null is none, any other value counts.
func (p *parser) toolDefs(d *span) bool {
	*d = span{start: p.i, end: p.i}
	var ok bool
	p.inPrompt = true
	switch p.s[p.i] {
	case '[', '{':
		ok = p.skipNested()
	case '"':
		ok = p.skipString()
	default:
		var lit []byte
		if lit, ok = p.literal(); ok && string(lit) == "null" {
			p.inPrompt = false
			return true
		}
	}
	p.inPrompt = false
	d.end, d.whole = p.i, ok
	return ok
}

// defsBytes is the length of the tool definitions' JSON as sent (in the head): prompt text.
func (p *parser) defsBytes() int64 {
	return int64(p.defs[0].end - p.defs[0].start + p.defs[1].end - p.defs[1].start)
}

// keyBehindDefs keys the chat's prompt again as the template writes it: the tool definitions, each
// followed by 0, then the messages, which the first pass keyed alone wherever the fields stood. The
// definitions are the application's, the same in each of its requests: their blocks count as shared,
// as a leading system message's do. A head that ends inside them keys their whole blocks only.
func (p *parser) keyBehindDefs() {
	if p.prompt == promptNone {
		p.prompt = promptText // definitions without messages: a head that ends before them
	}
	p.key.reset(seedText, p.key.blocks)
	p.previousBlocks = 0
	for _, d := range p.defs {
		if d.end == d.start {
			continue
		}
		p.key.write(p.s[d.start:d.end])
		if !d.whole {
			p.sharedBlocks = len(p.key.blocks)
			return
		}
		p.key.writeByte(0)
	}
	p.sharedBlocks = len(p.key.blocks)
	if p.messagesAt < 0 {
		return
	}
	// The messages' second walk keys them again; their text, flags and the head's end were found by
	// the first.
	text, cut, cutInPrompt := p.text, p.cut, p.cutInPrompt
	p.i = p.messagesAt
	p.inPrompt = true
	p.messages()
	p.inPrompt = false
	p.text, p.cut, p.cutInPrompt = text, cut, cutInPrompt
}

// boolean reads true or false into v; another value is skipped.
func (p *parser) boolean(v *bool) bool {
	if !isLiteral(p.s[p.i]) {
		return p.skipValue()
	}
	lit, ok := p.literal()
	switch string(lit) {
	case "true":
		*v = true
	case "false":
		*v = false
	}
	return ok
}

// integer reads an integer into v (and sets *present); null and other values are skipped.
func (p *parser) integer(v *int64, present *bool) bool {
	if !isLiteral(p.s[p.i]) {
		return p.skipValue()
	}
	lit, ok := p.literal()
	if !ok {
		return false
	}
	neg := len(lit) > 0 && lit[0] == '-'
	digits := lit
	if neg {
		digits = lit[1:]
	}
	if len(digits) == 0 {
		return true
	}
	var n int64
	for _, c := range digits {
		if c < '0' || c > '9' || n > (math.MaxInt64-int64(c-'0'))/10 {
			return true // not an integer, or too large for one
		}
		n = n*10 + int64(c-'0')
	}
	if neg {
		n = -n
	}
	*v = n
	if present != nil {
		*present = true
	}
	return true
}

// literal reads a number, true, false or null.
func (p *parser) literal() ([]byte, bool) {
	start := p.i
	for p.i < len(p.s) {
		switch p.s[p.i] {
		case ',', '}', ']', ' ', '\t', '\n', '\r', ':':
			if p.i == start {
				return nil, p.fail()
			}
			return p.s[start:p.i], true
		case '"', '{', '[':
			return nil, p.fail()
		}
		p.i++
	}
	return nil, p.end()
}

func isLiteral(c byte) bool { return c != '"' && c != '{' && c != '[' }

func (p *parser) skipValue() bool {
	was := p.skipping
	p.skipping = true
	var ok bool
	switch p.s[p.i] {
	case '"':
		ok = p.skipString()
	case '{', '[':
		ok = p.skipNested()
	default:
		_, ok = p.literal()
	}
	p.skipping = was
	return ok
}

// skipString moves past the string at p.i.
func (p *parser) skipString() bool {
	start := p.i + 1
	for i := start; ; {
		q := bytes.IndexByte(p.s[i:], '"')
		if q < 0 {
			p.i = len(p.s)
			return p.end()
		}
		q += i
		k := q
		for k > start && p.s[k-1] == '\\' {
			k--
		}
		if (q-k)%2 == 0 {
			p.i = q + 1
			return true
		}
		i = q + 1
	}
}

// skipNested moves past the object or array at p.i. It checks only that brackets balance.
func (p *parser) skipNested() bool {
	depth := 0
	for p.i < len(p.s) {
		switch p.s[p.i] {
		case '"':
			if !p.skipString() {
				return false
			}
			continue
		case '{', '[':
			depth++
		case '}', ']':
			depth--
			if depth == 0 {
				p.i++
				return true
			}
		}
		p.i++
	}
	return p.end()
}

// str scans the string at p.i. Its bytes as sent (escapes included) go to the key when key, and its
// length as sent, less a byte per backslash, counts as prompt text when count: the decoded length for
// \n, \" and every other two-byte escape but \\ (a byte short), five bytes for a \uXXXX (which
// decodes to one to three). Decoding visits each escape, a call apiece: a quarter of a Select with a
// 16 KiB prompt that has a newline per line of text. Counting backslashes is one vector pass, for a
// measure that only estimates tokens. Escapes are not checked, as skipString does not check them.
func (p *parser) str(key, count bool) bool {
	start := p.i + 1
	closed := p.skipString()
	end := len(p.s) // the head ends inside the string
	if closed {
		end = p.i - 1
	}
	raw := p.s[min(start, end):end]
	if key {
		p.key.write(raw)
	}
	if count {
		p.text += int64(len(raw) - bytes.Count(raw, backslash))
	}
	return closed
}

var backslash = []byte{'\\'}

// unescape decodes the escape at s[i] ('\\') into r as encoding/json does (an unpaired surrogate
// becomes U+FFFD). It returns the bytes written and where the escape ends; not ok with next at len(s)
// when s ends inside the escape, else at i for a bad escape.
func unescape(s []byte, i int, r *[4]byte) (n, next int, ok bool) {
	if i+1 >= len(s) {
		return 0, len(s), false
	}
	switch c := s[i+1]; c {
	case '"', '\\', '/':
		r[0] = c
	case 'b':
		r[0] = '\b'
	case 'f':
		r[0] = '\f'
	case 'n':
		r[0] = '\n'
	case 'r':
		r[0] = '\r'
	case 't':
		r[0] = '\t'
	case 'u':
		if i+6 > len(s) {
			return 0, len(s), false
		}
		c := hex4(s[i+2 : i+6])
		if c < 0 {
			return 0, i, false
		}
		if utf16.IsSurrogate(c) {
			if i+12 <= len(s) && s[i+6] == '\\' && s[i+7] == 'u' {
				if d := utf16.DecodeRune(c, hex4(s[i+8:i+12])); d != utf8.RuneError {
					return utf8.EncodeRune(r[:], d), i + 12, true
				}
			}
			c = utf8.RuneError
		}
		return utf8.EncodeRune(r[:], c), i + 6, true
	default:
		return 0, i, false
	}
	return 1, i + 2, true
}

func hex4(b []byte) rune {
	var r rune
	for _, c := range b {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c = c - 'a' + 10
		case 'A' <= c && c <= 'F':
			c = c - 'A' + 10
		default:
			return -1
		}
		r = r*16 + rune(c)
	}
	return r
}
