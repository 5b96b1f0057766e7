// Command jcsverify verifies xidstream's signed records (remediation commands, approvals) the way a
// consumer in another language would: RFC 8785 (JSON Canonicalization Scheme) written from the RFC
// with Go's standard library only, then Ed25519 (crypto/ed25519) over those bytes.
//
// Input, one JSON object per line on stdin:
//
//	{"record": {...signed record...}, "public_key": "<base64 of the 32-byte Ed25519 key>"}
//	{"document": {...any JSON...}}   (canonicalize only)
//
// Output, one JSON object per input line: {"ok": bool, "error": "...", "canonical": "<base64>"}.
//
// Input that RFC 8785 does not define (it requires I-JSON, RFC 7493) is refused, not repaired: a
// line that is not UTF-8, a lone surrogate escape, an object with a duplicate key, an integer
// beyond 2**53 that a double cannot hold. Go's decoder would otherwise map each of these onto
// another value (U+FFFD, the last duplicate, the nearest double), so two different records
// could verify under one signature.
package main

import (
	"bufio"
	"bytes"
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"sort"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"
)

// canonicalize writes v (decoded with UseNumber) as RFC 8785 JSON.
func canonicalize(buf *bytes.Buffer, v any) error {
	switch x := v.(type) {
	case nil:
		buf.WriteString("null")
	case bool:
		if x {
			buf.WriteString("true")
		} else {
			buf.WriteString("false")
		}
	case json.Number:
		f, err := strconv.ParseFloat(string(x), 64)
		if err != nil {
			return fmt.Errorf("number %s: %v", x, err)
		}
		if !strings.ContainsAny(string(x), ".eE") && math.Abs(f) > maxSafeInteger {
			return fmt.Errorf("integer %s is beyond 2**53 (I-JSON)", x)
		}
		s, err := es6Number(f)
		if err != nil {
			return err
		}
		buf.WriteString(s)
	case string:
		writeString(buf, x)
	case []any:
		buf.WriteByte('[')
		for i, e := range x {
			if i > 0 {
				buf.WriteByte(',')
			}
			if err := canonicalize(buf, e); err != nil {
				return err
			}
		}
		buf.WriteByte(']')
	case map[string]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		// RFC 8785 3.2.3: keys sorted by their UTF-16 code units
		sort.Slice(keys, func(i, j int) bool { return lessUTF16(keys[i], keys[j]) })
		buf.WriteByte('{')
		for i, k := range keys {
			if i > 0 {
				buf.WriteByte(',')
			}
			writeString(buf, k)
			buf.WriteByte(':')
			if err := canonicalize(buf, x[k]); err != nil {
				return err
			}
		}
		buf.WriteByte('}')
	default:
		return fmt.Errorf("unexpected JSON value %T", v)
	}
	return nil
}

const maxSafeInteger = 1<<53 - 1

// checkIJSON refuses what I-JSON (RFC 7493) forbids and Go's decoder would silently repair.
func checkIJSON(line []byte) error {
	if !utf8.Valid(line) {
		return fmt.Errorf("not UTF-8 (I-JSON)")
	}
	if err := checkSurrogates(line); err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.UseNumber()
	return checkDuplicates(dec)
}

// hex4 reads the 4 hex digits of a \u escape starting at line[i] (the backslash), or -1.
func hex4(line []byte, i int) int {
	if i+5 >= len(line) || line[i] != '\\' || line[i+1] != 'u' {
		return -1
	}
	v, err := strconv.ParseUint(string(line[i+2:i+6]), 16, 16)
	if err != nil {
		return -1
	}
	return int(v)
}

// checkSurrogates: every \uD800-\uDBFF escape is followed by a \uDC00-\uDFFF one, and no low
// surrogate stands alone.
func checkSurrogates(line []byte) error {
	inString := false
	for i := 0; i < len(line); i++ {
		c := line[i]
		if !inString {
			inString = c == '"'
			continue
		}
		if c == '"' {
			inString = false
			continue
		}
		if c != '\\' {
			continue
		}
		v := hex4(line, i)
		if v < 0xD800 || v > 0xDFFF {
			i++ // an escape that is no surrogate: skip the escaped character
			continue
		}
		if w := hex4(line, i+6); v >= 0xDC00 || w < 0xDC00 || w > 0xDFFF {
			return fmt.Errorf("lone surrogate \\u%04X (I-JSON)", v)
		}
		i += 11
	}
	return nil
}

// checkDuplicates walks one JSON value and refuses an object with a key twice.
func checkDuplicates(dec *json.Decoder) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	switch tok {
	case json.Delim('{'):
		seen := map[string]bool{}
		for dec.More() {
			key, err := dec.Token()
			if err != nil {
				return err
			}
			k, _ := key.(string)
			if seen[k] {
				return fmt.Errorf("duplicate key %q (I-JSON)", k)
			}
			seen[k] = true
			if err := checkDuplicates(dec); err != nil {
				return err
			}
		}
		_, err = dec.Token() // '}'
		return err
	case json.Delim('['):
		for dec.More() {
			if err := checkDuplicates(dec); err != nil {
				return err
			}
		}
		_, err = dec.Token() // ']'
		return err
	}
	return nil
}

func lessUTF16(a, b string) bool {
	ua, ub := utf16.Encode([]rune(a)), utf16.Encode([]rune(b))
	for i := 0; i < len(ua) && i < len(ub); i++ {
		if ua[i] != ub[i] {
			return ua[i] < ub[i]
		}
	}
	return len(ua) < len(ub)
}

// writeString: RFC 8785 3.2.2.2: only '"', '\\' and the control characters are escaped; the
// short forms where JSON has one, else \u00xx in lower case; everything else as UTF-8.
func writeString(buf *bytes.Buffer, s string) {
	buf.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"':
			buf.WriteString(`\"`)
		case '\\':
			buf.WriteString(`\\`)
		case '\b':
			buf.WriteString(`\b`)
		case '\f':
			buf.WriteString(`\f`)
		case '\n':
			buf.WriteString(`\n`)
		case '\r':
			buf.WriteString(`\r`)
		case '\t':
			buf.WriteString(`\t`)
		default:
			if r < 0x20 {
				fmt.Fprintf(buf, `\u%04x`, r)
			} else {
				buf.WriteRune(r)
			}
		}
	}
	buf.WriteByte('"')
}

// es6Number: ECMAScript's Number.prototype.toString (RFC 8785 3.2.2.3), from Go's shortest
// round-trip digits.
func es6Number(f float64) (string, error) {
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return "", fmt.Errorf("%v is not a JSON number", f)
	}
	if f == 0 {
		return "0", nil // -0 too
	}
	sign := ""
	if f < 0 {
		sign, f = "-", -f
	}
	e := strconv.FormatFloat(f, 'e', -1, 64) // d.ddddde±XX
	mant, expText, _ := strings.Cut(e, "e")
	digits := strings.Replace(mant, ".", "", 1)
	exp, _ := strconv.Atoi(expText)
	n := exp + 1 // the value is 0.digits * 10^n
	k := len(digits)
	var out string
	switch {
	case k <= n && n <= 21:
		out = digits + strings.Repeat("0", n-k)
	case 0 < n && n <= 21:
		out = digits[:n] + "." + digits[n:]
	case -6 < n && n <= 0:
		out = "0." + strings.Repeat("0", -n) + digits
	default:
		es := "+"
		if n-1 < 0 {
			es = "-"
		}
		abs := n - 1
		if abs < 0 {
			abs = -abs
		}
		if k == 1 {
			out = digits + "e" + es + strconv.Itoa(abs)
		} else {
			out = digits[:1] + "." + digits[1:] + "e" + es + strconv.Itoa(abs)
		}
	}
	return sign + out, nil
}

type result struct {
	OK        bool   `json:"ok"`
	Error     string `json:"error,omitempty"`
	Canonical string `json:"canonical,omitempty"`
}

func handle(line []byte) result {
	if err := checkIJSON(line); err != nil {
		return result{Error: err.Error()}
	}
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.UseNumber()
	var in map[string]any
	if err := dec.Decode(&in); err != nil {
		return result{Error: "not a JSON object: " + err.Error()}
	}
	if doc, ok := in["document"]; ok {
		var buf bytes.Buffer
		if err := canonicalize(&buf, doc); err != nil {
			return result{Error: err.Error()}
		}
		return result{OK: true, Canonical: base64.StdEncoding.EncodeToString(buf.Bytes())}
	}
	rec, ok := in["record"].(map[string]any)
	if !ok {
		return result{Error: "no record"}
	}
	pubText, _ := in["public_key"].(string)
	pub, err := base64.StdEncoding.DecodeString(pubText)
	if err != nil || len(pub) != ed25519.PublicKeySize {
		return result{Error: "public_key is not a base64 Ed25519 key"}
	}
	sigText, _ := rec["signature"].(string)
	sig, err := base64.StdEncoding.DecodeString(sigText)
	if err != nil || sigText == "" {
		return result{Error: "unsigned or signature not base64"}
	}
	sum := sha256.Sum256(pub)
	if kid, _ := rec["key_id"].(string); kid != hex.EncodeToString(sum[:])[:16] {
		return result{Error: fmt.Sprintf("key_id %q is not this key's", kid)}
	}
	delete(rec, "signature") // what is signed: everything else, key_id included
	var buf bytes.Buffer
	if err := canonicalize(&buf, rec); err != nil {
		return result{Error: err.Error()}
	}
	canon := base64.StdEncoding.EncodeToString(buf.Bytes())
	if !ed25519.Verify(ed25519.PublicKey(pub), buf.Bytes(), sig) {
		return result{Error: "signature does not verify", Canonical: canon}
	}
	return result{OK: true, Canonical: canon}
}

func main() {
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 16<<20)
	out := json.NewEncoder(os.Stdout)
	for in.Scan() {
		if len(bytes.TrimSpace(in.Bytes())) == 0 {
			continue
		}
		if err := out.Encode(handle(in.Bytes())); err != nil {
			os.Exit(1)
		}
	}
	if err := in.Err(); err != nil {
		fmt.Fprintln(os.Stderr, "jcsverify:", err)
		os.Exit(1)
	}
}
