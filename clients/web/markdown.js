// A small, safe subset of Markdown for the model's answers: fenced code blocks, headings, lists,
// paragraphs with line breaks, `code`, **bold**, *italic* and [links](https://...).
//
// Safe by construction: the text is never parsed as HTML. Every piece of it becomes a text node of an
// element built here, so `<img onerror=...>` in an answer shows as those characters; a link is made
// only for http(s) and mailto URLs (a `javascript:` or `data:` one stays text). Rendering the whole
// answer again on each paint keeps a block that is still streaming (an unclosed ``` fence) right.

const FENCE = /^\s*(```|~~~)\s*([\w+.#-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const ITEM = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/;
// `code`, **bold**, *italic* / _italic_ (not around spaces, so "2 * 3 * 4" stays as it is), [label](url).
const INLINE = /`([^`\n]+)`|\*\*(?!\s)([^*\n]+?)(?<!\s)\*\*|\*(?!\s)([^*\n]+?)(?<!\s)\*|\b_(?!\s)([^_\n]+?)(?<!\s)_\b|\[([^\]\n]+)\]\(([^)\s]+)\)/g;
const SAFE_URL = /^(https?:\/\/|mailto:)/i;

/** Replace the children of `target` with `source` rendered. */
export function renderMarkdown(target, source) {
  target.replaceChildren(...blocks(source.split("\n")));
}

function node(tag, text) {
  const el = document.createElement(tag);
  if (text !== undefined) el.textContent = text;
  return el;
}

function blocks(lines) {
  const out = [];
  for (let i = 0; i < lines.length;) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      const body = [];
      for (i += 1; i < lines.length && !lines[i].trim().startsWith(fence[1]); i += 1) body.push(lines[i]);
      i += 1; // the closing fence; while the answer streams there may be none yet
      const code = node("code", body.join("\n"));
      if (fence[2]) code.dataset.lang = fence[2];
      const pre = node("pre");
      pre.append(code);
      out.push(pre);
    } else if (HEADING.test(line)) {
      const [, marks, text] = HEADING.exec(line);
      out.push(inline(node(`h${Math.min(6, marks.length + 2)}`), text)); // h3..h6: smaller than the page's own
      i += 1;
    } else if (ITEM.test(line)) {
      const ordered = /\d/.test(ITEM.exec(line)[1]);
      const list = node(ordered ? "ol" : "ul");
      for (let m; i < lines.length && (m = ITEM.exec(lines[i])) && /\d/.test(m[1]) === ordered; i += 1) {
        list.append(inline(node("li"), m[2]));
      }
      out.push(list);
    } else if (!line.trim()) {
      i += 1;
    } else {
      const p = node("p");
      for (let first = true; i < lines.length && lines[i].trim() && !startsBlock(lines[i]); i += 1, first = false) {
        if (!first) p.append(node("br"));
        inline(p, lines[i]);
      }
      out.push(p);
    }
  }
  return out;
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || ITEM.test(line);
}

function inline(parent, text) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    parent.append(text.slice(last, m.index));
    const [whole, code, bold, star, under, label, url] = m;
    if (code !== undefined) parent.append(node("code", code));
    else if (bold !== undefined) parent.append(inline(node("strong"), bold));
    else if (star !== undefined || under !== undefined) parent.append(inline(node("em"), star ?? under));
    else parent.append(link(label, url, whole));
    last = m.index + whole.length;
  }
  parent.append(text.slice(last));
  return parent;
}

function link(label, url, whole) {
  if (!SAFE_URL.test(url)) return whole; // as text, never as a link
  const a = node("a", label);
  a.href = url;
  a.target = "_blank";
  a.rel = "noopener noreferrer nofollow";
  return a;
}
