// kubeinfer playground: Markdown to DOM nodes, for model replies.
// The model's text only ever becomes text nodes and a fixed set of elements made with createElement
// (never innerHTML): raw HTML in a reply stays visible text, links keep http(s) and mailto targets only,
// and images become links (the CSP would block them anyway, and a reply must not load anything).
// Covers what chat models write: ATX headings, paragraphs, emphasis, strikethrough, inline code,
// fenced code blocks (``` and ~~~, open fences while streaming), block quotes, nested lists, GFM tables,
// links and autolinks, thematic breaks, hard line breaks (a single newline is a break, as in chat UIs).
// Why not a vendored library: the well-kept ones (marked, markdown-it) produce an HTML string, which
// would have to be sanitized and then parsed as HTML, which this page never does; building
// nodes keeps that rule simple to hold and to test.
"use strict";

const Markdown = (() => {
  const SAFE_SCHEMES = new Set(["http:", "https:", "mailto:"]);
  const PUNCT = /[!-/:-@[-`{-~]/;
  // Bounds that keep a hostile reply (thousands of nested quotes, brackets or stars) from costing more
  // than linear-ish time or the call stack: deeper nesting stays text, longer link parts are not links.
  const MAX_NEST = 16;
  const MAX_LINK_PART = 2048;
  const MAX_COLUMNS = 64;

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // The href a link may carry, or null. Parsed by the browser's URL parser, so that tricks such as
  // "java\tscript:" or "JaVaScRiPt:" are judged as the browser would follow them.
  function safeHref(raw) {
    const text = raw.trim();
    if (!text) return null;
    let url;
    try {
      url = new URL(text, document.baseURI);
    } catch {
      return null;
    }
    return SAFE_SCHEMES.has(url.protocol) ? url.href : null;
  }

  function link(href, children) {
    const a = el("a");
    a.href = href;
    a.target = "_blank";
    a.rel = "noopener noreferrer nofollow";
    a.append(...children);
    return a;
  }

  // ---- inline --------------------------------------------------------------------------------------
  const isSpace = (c) => c === undefined || /\s/.test(c);
  const isWord = (c) => c !== undefined && /[\p{L}\p{N}]/u.test(c);

  // The index of the closing delimiter `delim` for an opener ending at `from`, or -1 (CommonMark's
  // flanking rules, simplified: no whitespace inside the delimiters, `_` never inside a word).
  // `misses` remembers where a search found nothing: a later opener finds nothing either, which keeps
  // a run of unclosed delimiters linear.
  function findCloser(text, from, delim, misses) {
    if (misses.has(delim) && from >= misses.get(delim)) return -1;
    let j = from;
    for (;;) {
      j = text.indexOf(delim, j);
      if (j < 0) {
        misses.set(delim, from);
        return -1;
      }
      const before = text[j - 1];
      const after = text[j + delim.length];
      const single = delim.length === 1;
      const doubled = single && (after === delim || before === delim);
      if (j > from && !isSpace(before) && !doubled && !(delim[0] === "_" && isWord(after))) return j;
      j += single && after === delim ? 2 : 1;
    }
  }

  // For each opening bracket in `text`, the index of its matching closing one (-1 when none), in one
  // pass with a stack (backslash-escaped brackets do not count).
  function matching(text, open, close) {
    const match = new Int32Array(text.length).fill(-1);
    const stack = [];
    for (let i = 0; i < text.length; i++) {
      const c = text[i];
      if (c === "\\") i++;
      else if (c === open) stack.push(i);
      else if (c === close && stack.length) match[stack.pop()] = i;
    }
    return match;
  }

  // `(url "title")` at `open`, on one line and not too long: [url, end index] or null
  function linkTarget(text, open, parens) {
    if (text[open] !== "(") return null;
    const end = parens[open];
    if (end < 0 || end - open > MAX_LINK_PART || text.slice(open, end).includes("\n")) return null;
    let dest = text.slice(open + 1, end).trim();
    const titled = dest.match(/^(\S+)\s+("[^"]*"|'[^']*')$/);
    if (titled) dest = titled[1];
    if (dest.startsWith("<") && dest.endsWith(">")) dest = dest.slice(1, -1);
    return [dest, end + 1];
  }

  const BARE_URL = /^(https?:\/\/[^\s<>"]+[^\s<>".,;:!?)\]'*_~])/;
  const AUTOLINK = /^<([a-zA-Z][a-zA-Z0-9+.-]{1,31}:[^\s<>]*)>/;

  function inline(text, allowLinks = true, depth = 0) {
    const out = [];
    const misses = new Map();
    let brackets = null; // computed on the first "[" (most text has none)
    let parens = null;
    let buf = "";
    const flush = () => {
      if (buf) out.push(document.createTextNode(buf));
      buf = "";
    };
    let i = 0;
    while (i < text.length) {
      const c = text[i];
      const rest = text.slice(i);
      if (c === "\\" && PUNCT.test(text[i + 1] || "")) {
        buf += text[i + 1];
        i += 2;
        continue;
      }
      if (c === "\\" && text[i + 1] === "\n") {
        flush();
        out.push(el("br"));
        i += 2;
        continue;
      }
      if (c === "\n") {
        flush();
        out.push(el("br"));
        i += 1;
        continue;
      }
      if (c === "`") {
        const run = rest.match(/^`+/)[0];
        const missed = misses.has(run) && i >= misses.get(run);
        let k = missed ? -1 : text.indexOf(run, i + run.length);
        // a longer run of backticks does not close a shorter one
        while (k >= 0 && (text[k + run.length] === "`" || text[k - 1] === "`")) {
          k = text.indexOf(run, k + 1);
        }
        if (k < 0) misses.set(run, i);
        if (k >= 0) {
          let code = text.slice(i + run.length, k).replace(/\n/g, " ");
          if (code.length > 2 && code.startsWith(" ") && code.endsWith(" ") && code.trim()) code = code.slice(1, -1);
          flush();
          out.push(el("code", "inline", code));
          i = k + run.length;
          continue;
        }
        buf += run;
        i += run.length;
        continue;
      }
      if (c === "*" || c === "_" || c === "~") {
        const double = text[i + 1] === c;
        const delim = double ? c + c : c;
        const okOpen = !isSpace(text[i + delim.length]) && !(c === "_" && isWord(text[i - 1]));
        if ((c !== "~" || double) && okOpen && depth < MAX_NEST) {
          const j = findCloser(text, i + delim.length, delim, misses);
          if (j > i + delim.length) {
            flush();
            const tag = c === "~" ? "del" : double ? "strong" : "em";
            const node = el(tag);
            node.append(...inline(text.slice(i + delim.length, j), allowLinks, depth + 1));
            out.push(node);
            i = j + delim.length;
            continue;
          }
        }
        buf += delim;
        i += delim.length;
        continue;
      }
      if (allowLinks && (c === "[" || (c === "!" && text[i + 1] === "["))) {
        const open = c === "!" ? i + 1 : i;
        if (brackets === null) {
          brackets = matching(text, "[", "]");
          parens = matching(text, "(", ")");
        }
        const close = brackets[open];
        const target = close > 0 && close - open <= MAX_LINK_PART ? linkTarget(text, close + 1, parens) : null;
        if (target) {
          const [dest, end] = target;
          const label = text.slice(open + 1, close);
          const href = safeHref(dest);
          flush();
          // an image is shown as a link to it, never loaded; an unsafe target leaves the text only
          const children = c === "!" ? [document.createTextNode(label || dest)] : inline(label, false, depth + 1);
          out.push(href ? link(href, children) : el("span", "unsafe-link", text.slice(i, end)));
          i = end;
          continue;
        }
      }
      if (allowLinks && c === "<") {
        const m = rest.match(AUTOLINK);
        if (m) {
          const href = safeHref(m[1]);
          flush();
          out.push(href ? link(href, [document.createTextNode(m[1])]) : document.createTextNode(m[0]));
          i += m[0].length;
          continue;
        }
      }
      if (allowLinks && (c === "h" || c === "H") && !isWord(text[i - 1])) {
        const m = rest.match(BARE_URL);
        if (m) {
          const href = safeHref(m[1]);
          if (href) {
            flush();
            out.push(link(href, [document.createTextNode(m[1])]));
            i += m[1].length;
            continue;
          }
        }
      }
      buf += c;
      i += 1;
    }
    flush();
    return out;
  }

  // ---- blocks --------------------------------------------------------------------------------------
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
  const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+|$)/;
  const HR = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}> ?(.*)$/;
  const BULLET = /^( {0,3})([-*+])(\s+)(.*)$/;
  const ORDERED = /^( {0,3})(\d{1,9})([.)])(\s+)(.*)$/;
  const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

  function listMarker(line) {
    let m = line.match(BULLET);
    if (m) return { ordered: false, indent: m[1].length + 1 + m[3].length, start: 1, text: m[4], kind: m[2] };
    m = line.match(ORDERED);
    if (m) {
      const width = m[1].length + m[2].length + 1 + m[4].length;
      return { ordered: true, indent: width, start: Number(m[2]), text: m[5], kind: m[3] };
    }
    return null;
  }

  function splitRow(line) {
    let s = line.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
    const cells = [];
    let cell = "";
    for (let i = 0; i < s.length; i++) {
      if (s[i] === "\\" && s[i + 1] === "|") {
        cell += "|";
        i++;
      } else if (s[i] === "|") {
        cells.push(cell.trim());
        cell = "";
      } else cell += s[i];
    }
    cells.push(cell.trim());
    return cells;
  }

  function startsBlock(line) {
    return FENCE.test(line) || HEADING.test(line) || HR.test(line) || QUOTE.test(line) || listMarker(line) !== null;
  }

  function codeBlock(code, lang) {
    const wrap = el("div", "codeblock");
    const pre = el("pre", "code");
    const node = el("code", "", code);
    if (lang) {
      node.dataset.lang = lang;
      wrap.dataset.lang = lang; // shown by CSS, so that it is not part of the reply's text
    }
    const copy = el("button", "copy copy-code");
    copy.type = "button";
    copy.setAttribute("aria-label", lang ? `Copy ${lang} code` : "Copy code");
    copy.dataset.copy = code;
    pre.append(node);
    wrap.append(copy, pre);
    return wrap;
  }

  function blocks(lines, depth = 0) {
    if (depth >= MAX_NEST) {
      const p = el("p");
      p.append(...inline(lines.join("\n"), true, depth));
      return [p];
    }
    const out = [];
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      if (!line.trim()) {
        i++;
        continue;
      }
      let m = line.match(FENCE);
      if (m) {
        // a fence still open (while streaming) runs to the end of the text so far
        const fence = m[1];
        const close = new RegExp(`^ {0,3}${fence[0] === "`" ? "`" : "~"}{${fence.length},}\\s*$`);
        const body = [];
        i++;
        while (i < lines.length && !close.test(lines[i])) body.push(lines[i++]);
        i++;
        out.push(codeBlock(body.join("\n"), m[2]));
        continue;
      }
      m = line.match(HEADING);
      if (m) {
        const h = el(`h${m[1].length}`);
        // an optional closing run of #s, after a space, is not part of the heading
        let title = line.slice(m[0].length).trimEnd();
        let k = title.length;
        while (k > 0 && title[k - 1] === "#") k--;
        const bare = title.slice(0, k);
        if (bare !== title && (bare === "" || /[ \t]$/.test(bare))) title = bare.trimEnd();
        h.append(...inline(title));
        out.push(h);
        i++;
        continue;
      }
      if (HR.test(line)) {
        out.push(el("hr"));
        i++;
        continue;
      }
      if (QUOTE.test(line)) {
        const inner = [];
        while (i < lines.length && lines[i].trim() && (QUOTE.test(lines[i]) || !startsBlock(lines[i]))) {
          const q = lines[i].match(QUOTE);
          inner.push(q ? q[1] : lines[i]);
          i++;
        }
        const quote = el("blockquote");
        quote.append(...blocks(inner, depth + 1));
        out.push(quote);
        continue;
      }
      const marker = listMarker(line);
      if (marker) {
        const list = el(marker.ordered ? "ol" : "ul");
        if (marker.ordered && marker.start !== 1) list.start = marker.start;
        let loose = false;
        while (i < lines.length) {
          const item = listMarker(lines[i]);
          if (!item || item.ordered !== marker.ordered || item.kind !== marker.kind) break;
          const body = [item.text];
          i++;
          // the item's own lines: indented continuation, and blank lines followed by more of it
          while (i < lines.length) {
            const next = lines[i];
            const indent = next.match(/^\s*/)[0].length;
            if (!next.trim()) {
              const after = lines[i + 1];
              if (after !== undefined && after.trim() && after.match(/^\s*/)[0].length >= item.indent) {
                body.push("");
                i++;
                continue;
              }
              break;
            }
            if (indent >= item.indent) body.push(next.slice(item.indent));
            else if (!startsBlock(next) && body[body.length - 1] !== "") body.push(next.trim());
            else break;
            i++;
          }
          const following = lines[i] === undefined || lines[i].trim() ? null : listMarker(lines[i + 1] || "");
          if (following && following.ordered === marker.ordered && following.kind === marker.kind) {
            loose = true; // items apart by blank lines: paragraphs, from this item on
            i++;
          }
          const li = el("li");
          const parts = blocks(body, depth + 1);
          // a tight list's single paragraph is the item's text itself
          if (parts.length && parts[0].tagName === "P" && !loose) {
            li.append(...parts[0].childNodes);
            li.append(...parts.slice(1));
          } else li.append(...parts);
          list.append(li);
        }
        out.push(list);
        continue;
      }
      const head = line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1]) && lines[i + 1].includes("-")
        ? splitRow(line)
        : null;
      if (head && head.length <= MAX_COLUMNS) {
        const aligns = splitRow(lines[i + 1]).map((s) =>
          s.startsWith(":") && s.endsWith(":") ? "center" : s.endsWith(":") ? "right" : s.startsWith(":") ? "left" : ""
        );
        const table = el("table");
        const thead = el("thead");
        const tr = el("tr");
        head.forEach((cell, k) => {
          const th = el("th");
          if (aligns[k]) th.className = `align-${aligns[k]}`;
          th.append(...inline(cell));
          tr.append(th);
        });
        thead.append(tr);
        table.append(thead);
        const tbody = el("tbody");
        i += 2;
        while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
          const row = el("tr");
          splitRow(lines[i]).slice(0, head.length).forEach((cell, k) => {
            const td = el("td");
            if (aligns[k]) td.className = `align-${aligns[k]}`;
            td.append(...inline(cell));
            row.append(td);
          });
          tbody.append(row);
          i++;
        }
        table.append(tbody);
        const scroll = el("div", "table-wrap");
        scroll.append(table);
        out.push(scroll);
        continue;
      }
      // a paragraph: lines up to a blank line or the start of another block
      const para = [line.trim()];
      i++;
      while (i < lines.length && lines[i].trim() && !startsBlock(lines[i])) {
        if (lines[i + 1] !== undefined && TABLE_SEP.test(lines[i + 1]) && lines[i].includes("|")) break;
        para.push(lines[i].trim());
        i++;
      }
      const p = el("p");
      p.append(...inline(para.join("\n")));
      out.push(p);
    }
    return out;
  }

  // Renders `text` (Markdown) into `container`, replacing what was there.
  function render(container, text) {
    container.replaceChildren(...blocks(text.replace(/\r\n?/g, "\n").split("\n")));
  }

  return { render, safeHref, inline };
})();
