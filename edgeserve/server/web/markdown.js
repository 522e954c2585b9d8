// A small Markdown renderer for answers as they stream: fenced code blocks (one still open renders as code),
// inline code, bold and italics, headings, lists, quotes, links and paragraphs. Every piece of text is escaped
// before any markup is added, so an answer can never inject HTML; links keep only http(s) and mailto targets.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const SAFE_URL = /^(https?:\/\/|mailto:)/i;

function inline(text) {
  // code spans first: nothing inside them is markup
  const parts = text.split(/(`+)([\s\S]*?[^`])\1(?!`)/);
  let out = "";
  for (let i = 0; i < parts.length; i += 3) {
    out += emphasis(parts[i]);
    if (i + 2 < parts.length) out += `<code>${escapeHtml(parts[i + 2])}</code>`;
  }
  return out;
}

function emphasis(text) {
  // links are set aside first, so that emphasis never reaches into a target (a_b_c in a URL)
  const links = [];
  let html = escapeHtml(text).replace(/\[([^\]\n]+)\]\(([^)\s]+)\)/g, (whole, label, url) => {
    if (!SAFE_URL.test(url)) return whole;
    links.push(`<a href="${url}" target="_blank" rel="noopener noreferrer">${styled(label)}</a>`);
    return `\u0000${links.length - 1}\u0000`;
  });
  html = styled(html);
  return html.replace(/\u0000(\d+)\u0000/g, (_, n) => links[Number(n)]).replace(/\n/g, "<br>");
}

function styled(html) {
  html = html.replace(/(\*\*|__)(?=\S)([\s\S]*?\S)\1/g, "<strong>$2</strong>");
  html = html.replace(/(^|[^*\w])\*(?=[^\s*])([^*\n]*?[^\s*])\*(?!\*)/g, "$1<em>$2</em>");
  return html.replace(/(^|[^_\w])_(?=[^\s_])([^_\n]*?[^\s_])_(?![_\w])/g, "$1<em>$2</em>");
}

const FENCE = /^ {0,3}(```+|~~~+)\s*([\w+#.-]*)\s*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const RULE = /^ {0,3}([-*_])( *\1){2,}\s*$/;

// Blocks of lines: a list runs while its lines are items or indented continuations.
export function renderMarkdown(source) {
  const lines = source.replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      const body = [];
      i++;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
      i++; // the closing fence, when the answer has written it
      const lang = fence[2] ? ` class="language-${escapeHtml(fence[2])}"` : "";
      const label = fence[2] ? `<span class="code-lang">${escapeHtml(fence[2])}</span>` : "";
      out.push(`<pre>${label}<code${lang}>${escapeHtml(body.join("\n"))}</code></pre>`);
      continue;
    }
    if (!line.trim()) { i++; continue; }
    const heading = line.match(HEADING);
    if (heading) {
      const level = heading[1].length;
      out.push(`<h${level}>${inline(heading[2])}</h${level}>`);
      i++;
      continue;
    }
    if (RULE.test(line)) { out.push("<hr>"); i++; continue; }
    if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && QUOTE.test(lines[i])) body.push(lines[i++].match(QUOTE)[1]);
      out.push(`<blockquote>${renderMarkdown(body.join("\n"))}</blockquote>`);
      continue;
    }
    if (ITEM.test(line)) {
      const items = [];
      const ordered = /\d/.test(line.match(ITEM)[2]);
      const start = ordered ? parseInt(line.match(ITEM)[2], 10) : 1;
      while (i < lines.length) {
        const item = lines[i].match(ITEM);
        if (item && (/\d/.test(item[2]) === ordered) && item[1].length < 2) {
          items.push([item[3]]);
        } else if (items.length && lines[i].trim() && (/^\s/.test(lines[i]) || !isBlockStart(lines[i]))) {
          items[items.length - 1].push(lines[i].replace(/^ {1,4}/, ""));
        } else if (!lines[i].trim() && i + 1 < lines.length && /^\s+\S/.test(lines[i + 1])) {
          items[items.length - 1].push("");
        } else {
          break;
        }
        i++;
      }
      const tag = ordered ? "ol" : "ul";
      const first = ordered && start !== 1 ? ` start="${start}"` : "";
      const body = items.map((item) => {
        const [head, ...rest] = item;
        const nested = rest.length ? renderMarkdown(rest.join("\n")) : "";
        return `<li>${inline(head)}${nested}</li>`;
      }).join("");
      out.push(`<${tag}${first}>${body}</${tag}>`);
      continue;
    }
    const paragraph = [];
    while (i < lines.length && lines[i].trim() && (!paragraph.length || !isBlockStart(lines[i]))) {
      paragraph.push(lines[i++]);
    }
    out.push(`<p>${inline(paragraph.join("\n"))}</p>`);
  }
  return out.join("");
}

function isBlockStart(line) {
  return FENCE.test(line) || HEADING.test(line) || ITEM.test(line) || QUOTE.test(line) || RULE.test(line);
}
